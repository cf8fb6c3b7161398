"""Max pooling ops: resfuse::max_pool2d (forward) and resfuse::max_pool2d_backward, which passes/pooling.py puts
in place of aten.max_pool2d_with_indices and its backward.

max_pool2d returns (out, indices) as ATen does, with the same layouts; when the graph never reads the indices
(inference) it skips writing them and returns an empty tensor in their place, and where only our backward reads
them (training) it writes int8 window codes in place of ATen's int64 (kernels/max_pool.py). max_pool2d_backward is
aten.max_pool2d_with_indices_backward, optionally followed by relu's gradient (threshold_backward(result, mask,
threshold)), which the stem's relu -> max-pool puts right after it. max_pool2d_epilogue (inference) pools
epilogue(x), an epilogue taken over from the conv that produced x (the stem's batch norm and relu), without
writing that value.

Paths, recorded in PATHS: "triton" (kernels/max_pool.py, on CUDA or under the interpreter) or "reference" (ATen).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from . import library
from .fused import _finish, _record, _use_triton

aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def _layouts(shape, strides, dtype, device, kernel, stride, padding, dilation, ceil_mode) -> tuple:
    """(out shape, out strides, indices strides, grad_input strides) as ATen gives them for this input."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty_strided(shape, strides, dtype=dtype, device=device)
        out, idx = aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
        dx = aten.max_pool2d_with_indices_backward(out, x, kernel, stride, padding, dilation, ceil_mode, idx)
        return tuple(out.shape), out.stride(), idx.stride(), dx.stride()


def _layout_of(x, kernel, stride, padding, dilation, ceil_mode) -> tuple:
    return _layouts(tuple(x.shape), x.stride(), x.dtype, x.device, tuple(kernel), tuple(stride), tuple(padding),
                    tuple(dilation), bool(ceil_mode))


def max_pool2d_impl(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                    dilation: Sequence[int], ceil_mode: bool, index_dtype: Optional[torch.dtype],
                    provider: str) -> tuple[torch.Tensor, torch.Tensor]:
    """index_dtype: None (no indices: an empty tensor), torch.int64 (ATen's), or int8 / int16 (window codes)."""
    if _use_triton(x.device, provider):
        from .. import kernels

        _record("max_pool2d", "window codes" if index_dtype not in (None, torch.int64) else "", "triton")
        shape, strides, idx_strides, _ = _layout_of(x, kernel, stride, padding, dilation, ceil_mode)
        out = torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)
        idx = (torch.empty_strided(shape, idx_strides, dtype=index_dtype, device=x.device) if index_dtype
               else x.new_empty(0, dtype=torch.int64))
        kernels.max_pool2d(x, kernel, stride, padding, dilation, out, idx if index_dtype else None)
        return out, idx
    if index_dtype not in (None, torch.int64):
        raise ValueError(f"window codes ({index_dtype}) come only from resfuse's kernel, not from ATen's path")
    _record("max_pool2d", "", "reference")
    out, idx = aten.max_pool2d_with_indices(x, list(kernel), list(stride), list(padding), list(dilation), ceil_mode)
    return out, idx if index_dtype else idx.new_empty(0)


max_pool2d = library.Op("max_pool2d", max_pool2d_impl)


@max_pool2d.register_fake
def _(x, kernel, stride, padding, dilation, ceil_mode, index_dtype, provider):
    # ATen's meta function on the fake input itself (its batch may be symbolic: no cache here)
    out, idx = aten.max_pool2d_with_indices(x, list(kernel), list(stride), list(padding), list(dilation), ceil_mode)
    return torch.empty_like(out), torch.empty_like(idx, dtype=index_dtype) if index_dtype else idx.new_empty(0)


def max_pool2d_epilogue_impl(x: torch.Tensor, operands: list[torch.Tensor], epilogue: str, kernel: Sequence[int],
                             stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], ceil_mode: bool,
                             provider: str) -> torch.Tensor:
    if _use_triton(x.device, provider):
        from .. import kernels

        _record("max_pool2d", epilogue, "triton")
        shape, strides, _, _ = _layout_of(x, kernel, stride, padding, dilation, ceil_mode)
        out = torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)
        return kernels.max_pool2d_epilogue(x, operands, epilogue, kernel, stride, padding, dilation, out)
    _record("max_pool2d", epilogue, "reference")
    y = _finish(x, torch.empty_like(x), operands, epilogue, 1)
    return aten.max_pool2d_with_indices(y, list(kernel), list(stride), list(padding), list(dilation), ceil_mode)[0]


max_pool2d_epilogue = library.Op("max_pool2d_epilogue", max_pool2d_epilogue_impl)


@max_pool2d_epilogue.register_fake
def _(x, operands, epilogue, kernel, stride, padding, dilation, ceil_mode, provider):
    out, _ = aten.max_pool2d_with_indices(x, list(kernel), list(stride), list(padding), list(dilation), ceil_mode)
    return torch.empty_like(out)


def max_pool2d_backward_impl(grad_out: torch.Tensor, x: torch.Tensor, indices: torch.Tensor, kernel: Sequence[int],
                             stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], ceil_mode: bool,
                             mask: Optional[torch.Tensor], threshold: float, provider: str) -> torch.Tensor:
    if _use_triton(x.device, provider):
        from .. import kernels

        _record("max_pool2d_backward", "window codes" if indices.dtype != torch.int64 else "", "triton")
        dx_strides = _layout_of(x, kernel, stride, padding, dilation, ceil_mode)[3]
        dx = torch.empty_strided(x.shape, dx_strides, dtype=grad_out.dtype, device=x.device)
        return kernels.max_pool2d_backward(grad_out, indices, kernel, stride, padding, dilation, dx, mask, threshold,
                                           mask is not None and _same_view(mask, x))
    _record("max_pool2d_backward", "", "reference")
    if indices.dtype != torch.int64:
        indices = aten_indices(indices, x.shape[3], kernel, stride, padding, dilation)
    dx = aten.max_pool2d_with_indices_backward(grad_out, x, list(kernel), list(stride), list(padding), list(dilation),
                                               ceil_mode, indices)
    return dx if mask is None else aten.threshold_backward(dx, mask, threshold)


def aten_indices(codes: torch.Tensor, width: int, kernel, stride, padding, dilation) -> torch.Tensor:
    """ATen's indices (ih * W + iw) from window codes: for a backward that ATen runs (the pass refused it after
    its forward wrote codes)."""
    from ..kernels import WINDOW_NOT_POSITIVE

    tap = codes.long() & (WINDOW_NOT_POSITIVE - 1)
    oh = torch.arange(codes.shape[2], device=codes.device).view(-1, 1)
    ow = torch.arange(codes.shape[3], device=codes.device)
    ih = oh * stride[0] - padding[0] + tap // kernel[1] * dilation[0]
    return ih * width + ow * stride[1] - padding[1] + tap % kernel[1] * dilation[1]


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Are a and b the same elements of the same memory? A backward graph gets the stem's relu output twice, as
    the pool's input and as relu's mask (a detached alias), in two placeholders: only at run time are they one."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


max_pool2d_backward = library.Op("max_pool2d_backward", max_pool2d_backward_impl)


@max_pool2d_backward.register_fake
def _(grad_out, x, indices, kernel, stride, padding, dilation, ceil_mode, mask, threshold, provider):
    dx = aten.max_pool2d_with_indices_backward(grad_out, x, list(kernel), list(stride), list(padding),
                                               list(dilation), ceil_mode, indices)
    return torch.empty_like(dx)
