"""Launching the fused kernels: argument checks, [S, P, C] operand views, config choice and the grid.

Entry points: `conv2d(x, w, operands, signature, stride, padding, dilation, out) -> out` and
`gemm(a, b, operands, signature, out) -> out`, reached through resfuse.kernels (ops/fused.py calls those).
`out` is preallocated by the caller; the kernels write into it through its own strides.
"""
from __future__ import annotations

import functools

import torch
import triton

from .. import epilogue as epi
from . import codegen, options, split_k
from .conv2d_fprop import FAMILY as CONV_FAMILY, ConvProblem, default_config as conv_config
from .matmul import FAMILY as GEMM_FAMILY, GemmProblem, default_config as gemm_config

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another; split-K buys nothing there
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_inputs(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    if p.dtype not in _DTYPES or q.dtype != p.dtype or out.dtype != p.dtype:
        raise TypeError(f"resfuse kernels need matching fp16/bf16/fp32 inputs and output, got "
                        f"{p.dtype}, {q.dtype} -> {out.dtype}")
    if not (p.device == q.device == out.device):
        raise ValueError(f"inputs and output on different devices: {p.device}, {q.device}, {out.device}")


def _operand_args(signature: str, operands, out_shape, channel_dim: int) -> list:
    """Pointer and [S, P, C] strides for each operand slot the epilogue reads, in triton_params order."""
    args = []
    for t3 in epi.operand_views(epi.parse(signature), operands, out_shape, channel_dim):
        args += [t3, *t3.stride()]
    return args


def _split(config_split: int) -> int:
    forced = options()["split_k"]
    return int(forced) if forced is not None else config_split


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16 and options()["interpret"]:
        return "upcast"  # see tiles.mma: the interpreter's bf16 dot is broken
    # fp32 runs as tf32 on tensor cores (what cuBLAS does with allow_tf32); fp16/bf16 ignore this
    return "tf32" if dtype == torch.float32 else "ieee"


def _gemm_out_view(out: torch.Tensor, batched: bool, m: int, n: int) -> tuple[int, int, int, int, int]:
    """(rows per sample, batch, sample, row and column strides) of `out` as the kernel writes it.

    `out` is the product's shape, or (for an [M, K] @ [K, N]) a view of it that keeps the last dim, such as
    the [B, S, N] of a linear layer; the epilogue's samples are then out.shape[0] (see epilogue.rows3).
    """
    if batched:
        if out.dim() != 3:
            raise NotImplementedError(f"a batched gemm writes a [B, M, N] output, got {tuple(out.shape)}")
        return m, out.stride(0), 0, out.stride(1), out.stride(2)
    if out.dim() == 2:
        return m, 0, 0, out.stride(0), out.stride(1)
    samples = out.shape[0]
    try:
        o3 = out.view(samples, m // samples, n)
    except RuntimeError as e:
        raise NotImplementedError(f"gemm output {tuple(out.shape)} with strides {out.stride()} is not a "
                                  f"[samples, rows, N] view") from e
    return m // samples, 0, o3.stride(0), o3.stride(1), o3.stride(2)


def gemm(a: torch.Tensor, b: torch.Tensor, operands, signature: str, out: torch.Tensor) -> torch.Tensor:
    _check_inputs(a, b, out)
    if a.dim() not in (2, 3) or b.dim() not in (2, 3) or b.dim() > a.dim():
        raise NotImplementedError(f"gemm kernel takes [M,K]@[K,N], [B,M,K]@[B,K,N] or [B,M,K]@[K,N]; got "
                                  f"{tuple(a.shape)} @ {tuple(b.shape)}")
    if out.numel() == 0:
        return out
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2:]
    n = b.shape[-1]
    s_ab = a.stride(0) if a.dim() == 3 else 0
    s_bb = b.stride(0) if b.dim() == 3 else 0  # a 2-D B is shared by every batch
    rps, s_ob, s_os, s_om, s_on = _gemm_out_view(out, a.dim() == 3, m, n)
    cfg = gemm_config(GemmProblem(batch, m, n, k, a.element_size(), _sms(a.device)))
    split = _split(cfg.split_k)
    tiles_mn = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    ws, tickets = split_k.buffers(a.device, tiles_mn * batch, split, cfg.block_m, cfg.block_n)
    kernel = codegen.load(GEMM_FAMILY, signature)
    kernel[(tiles_mn, batch, split)](
        out, ws, tickets, a, b, m, n, k, rps, s_ab, a.stride(-2), a.stride(-1), s_bb, b.stride(-2), b.stride(-1),
        s_ob, s_os, s_om, s_on, *_operand_args(signature, operands, out.shape, -1),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split,
        EVEN_K=k % cfg.block_k == 0, PRECISION=_precision(a.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def conv2d(x: torch.Tensor, w: torch.Tensor, operands, signature: str, stride, padding, dilation,
           out: torch.Tensor) -> torch.Tensor:
    _check_inputs(x, w, out)
    nb, c, h, wd = x.shape
    ko, cw, r, s = w.shape
    if cw != c:
        raise NotImplementedError(f"conv2d kernel supports groups=1 only (input C={c}, weight C={cw})")
    oh, ow = out.shape[2:]
    if out.numel() == 0:
        return out
    cfg = conv_config(ConvProblem(nb, c, ko, r, s, oh, ow, x.element_size(), _sms(x.device)))
    split = _split(cfg.split_k)
    tiles = triton.cdiv(nb * oh * ow, cfg.block_m) * triton.cdiv(ko, cfg.block_n)
    ws, tickets = split_k.buffers(x.device, tiles, split, cfg.block_m, cfg.block_n)
    kernel = codegen.load(CONV_FAMILY, signature)
    s_on, s_ok, s_oh, s_ow = out.stride()
    kernel[(tiles, 1, split)](
        out, ws, tickets, x, w, nb, h, wd, c, ko, oh, ow, r, s,
        x.stride(0), x.stride(1), x.stride(2), x.stride(3), w.stride(0), w.stride(1), w.stride(2), w.stride(3),
        s_on, s_oh, s_ow, stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
        s_ok, *_operand_args(signature, operands, out.shape, 1),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split, FLAT=cfg.flat,
        PRECISION=_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
