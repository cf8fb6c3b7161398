"""Which mainloop can read a call's operands, and as which matrices: the views and checks that the launch plans
(launch.py) and the tuning space (tuning/space.py) share, reached through launch as before.

Entry points: `tma_operands(a, b)` (the GEMM's TMA mainloop), `conv_as_gemm` / `is_gemm_conv` / `gemm_views` (a 1x1
stride-1 channels_last conv as a GEMM), `dgrad_as_gemm` (its data gradient likewise), `conv_tma_operands` (the conv's
TMA box mainloop).
"""
from __future__ import annotations

import torch

from ..ops.fused import dense_strides


def tma_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """(the matrix B's descriptor covers, whether it is [K, N]) when the TMA mainloop can read a 2-D A and B,
    else None. A tensor descriptor needs a row-major matrix whose base and row stride are 16-byte aligned."""
    def ok(t):
        return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
    if a.dim() != 2 or b.dim() != 2 or not ok(a):
        return None
    if ok(b):
        return b, True
    return (b.t(), False) if ok(b.t()) else None


def conv_as_gemm(x: torch.Tensor, w: torch.Tensor, stride, padding, out_strides):
    """(x, w) -> (A [N*H*W, C], B [C, K]) views when the conv is a plain GEMM (is_gemm_conv) that TMA descriptors
    can read; else None."""
    if not is_gemm_conv(x, w, stride, padding, out_strides):
        return None
    a, b = gemm_views(x, w)
    return (a, b) if tma_operands(a, b) is not None else None


def is_gemm_conv(x: torch.Tensor, w: torch.Tensor, stride, padding, out_strides) -> bool:
    """The conv is a plain GEMM (gemm_views): a 1x1 kernel, stride 1, no padding, a channels_last input, an output
    (its strides given) whose H and W merge into rows."""
    n, c, h, wd = x.shape
    return (w.shape[2:] == (1, 1) and list(stride) == [1, 1] and list(padding) == [0, 0] and w.shape[1] == c
            and x.permute(0, 2, 3, 1).is_contiguous() and out_strides[2] == wd * out_strides[3])


def gemm_views(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """conv_as_gemm's views without its checks: what a plan's calls take, once its first call (whose shapes,
    strides and alignment the plan's key fixes) has passed them."""
    n, c, h, wd = x.shape
    return x.permute(0, 2, 3, 1).reshape(n * h * wd, c), w.reshape(w.shape[0], c).t()


def dgrad_as_gemm(grad_out: torch.Tensor, w: torch.Tensor, stride, padding, out_strides):
    """(grad_out, w) -> (A [N*H*W, K], B [K, C]) views when a conv's data gradient is a plain GEMM that TMA
    descriptors can read: the forward conv's GEMM with the weight transposed (conv_as_gemm's conditions)."""
    return conv_as_gemm(grad_out, w.transpose(0, 1), stride, padding, out_strides)


def conv_tma_operands(x: torch.Tensor, w: torch.Tensor, stride) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x as NHWC, w as KRSC) views when conv2d_tma_mainloop can read them through descriptors: stride 1,
    groups 1, channels_last input and weight, channel rows 16-byte aligned; else None."""
    xv, wv = x.permute(0, 2, 3, 1), w.permute(0, 2, 3, 1)
    if list(stride) != [1, 1] or w.shape[1] != x.shape[1] or not (xv.is_contiguous() and wv.is_contiguous()):
        return None
    aligned = all(t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0 for t in (xv, wv))
    if not aligned:
        return None
    # the strides a descriptor checks, a size-1 dim's included (torch may give those stride 1)
    return tuple(t.as_strided(t.shape, dense_strides(t.shape), t.storage_offset()) for t in (xv, wv))
