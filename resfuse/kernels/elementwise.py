"""Epilogue-only family: the accumulator comes from memory (a cuDNN conv's or cuBLAS matmul's output) and
one generated kernel applies the whole epilogue to it. The "aten+epilogue" provider, torch.compile's way of
fusing, which the tuner weighs against our fused kernels and the fully unfused baseline.

The tiles run from the last rows to the first. The producer (a conv or GEMM) writes its rows from the first to
the last, so the last are the ones still in L2 (50 MB on an H100); and the consumer, which reads from the first
rows, finds this pass's last writes there too.

Entry points: `epilogue(acc, operands, signature, out, channel_dim, aux=None, stats=None) -> out` (reached through
resfuse.kernels; the launch, its checks and its plan), `ewise_mainloop` (@triton.jit, wrapped by codegen.py),
`FAMILY`, `EwiseConfig`, `default_config`. An epilogue with an aux node also writes `aux`, laid out like `out`; one
with a bn_stats root also writes `stats`, fp32 [2, C] (each row block's sums go to a [2, C, row blocks] workspace,
added up in a fixed order).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import epilogue as epi
from . import codegen
from .codegen import Family
from .plan import _PLANS, Plan, check_outputs, descriptor_operands, operand_strides, plan_key
from .tiles import cdiv


@triton.jit
def ewise_mainloop(src, M, N, RPS, s_ss, s_sp, s_sc, s_os, s_op,
                   BM: tl.constexpr, BN: tl.constexpr, KV: tl.constexpr, SPLIT_K: tl.constexpr):
    """Load one [BM, BN] tile of the [S, P, C] source as the fp32 accumulator; rows run over S * P, last first.
    The source's and output's sample and row strides come divided by KV, which also divides N, and the channel
    mask compares whole vectors of KV channels (codegen's Family.col_vec): Triton knows only 16-divisible
    arguments, and 72 or 120 channels would otherwise load and store 2 bytes at a time."""
    pid = tl.program_id(0)
    tiles_n = cdiv(N, BN)
    tile_m = cdiv(M, BM) - 1 - pid // tiles_n
    offs_m = tile_m * BM + tl.arange(0, BM)
    offs_n = (pid % tiles_n) * BN + tl.arange(0, BN)
    s_idx = offs_m // RPS
    p_idx = offs_m % RPS
    row_ok = offs_m < M
    ok = row_ok[:, None] & (offs_n // KV < N // KV)[None, :]
    acc = tl.load(src + ((s_idx * s_ss + p_idx * s_sp) * KV)[:, None] + offs_n[None, :] * s_sc, mask=ok, other=0.0)
    return acc.to(tl.float32), pid, 0, s_idx, p_idx, row_ok, (s_idx * s_os + p_idx * s_op) * KV, offs_n, tile_m


@triton.jit
def ewise_origin(tile, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """The first row and column of ewise_mainloop's tile `tile` (codegen's Family.origin)."""
    tiles_n = cdiv(N, BN)
    return (cdiv(M, BM) - 1 - tile // tiles_n) * BM, (tile % tiles_n) * BN


FAMILY = Family(
    name="ewise", module=__name__, mainloop="ewise_mainloop",
    args=("src", "M", "N", "RPS", "s_ss", "s_sp", "s_sc", "s_os", "s_op"),
    constexprs=("BM", "BN", "KV", "SPLIT_K"),
    n_cols="N", s_out_c="s_oc", origin="ewise_origin(tile, M, N, BM, BN)", col_vec="KV",
)


def channel_vector(channels: int, *strides: int) -> int:
    """KV for a channel count and the row strides that a kernel's loads and stores along the channels use: 1 where
    all are 16-divisible (Triton's own specialisation vectorises those), else the largest of 8, 4, 2, 1 dividing
    them all. Shared with the depthwise conv (launch.py)."""
    values = (channels, *strides)
    if all(v % 16 == 0 for v in values):
        return 1
    return next(v for v in (8, 4, 2, 1) if all(k % v == 0 for k in values))


@dataclasses.dataclass(frozen=True)
class EwiseConfig:
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4


def default_config(channels: int, stats: bool = False) -> EwiseConfig:
    """Wide tiles along the channels (contiguous in channels_last and in a GEMM's rows). With batch-norm sums
    (a bn_stats root), 4x taller tiles: each tile writes 2 x BN fp32 partial sums, 4 / BM of an fp16 tile's
    bytes (3% at 128 rows, 12% at 32)."""
    bn = 128 if channels >= 128 else 64 if channels >= 64 else 32
    rows = 8192 // bn // 2
    return EwiseConfig(block_m=rows * 4 if stats else rows, block_n=bn, num_warps=8 if stats else 4)


def epilogue(acc: torch.Tensor, operands, signature: str, out: torch.Tensor, channel_dim: int,
             aux: torch.Tensor | None = None, stats: torch.Tensor | None = None) -> torch.Tensor:
    """Apply the epilogue to an accumulator already in memory (`acc`, shaped like `out`), in one kernel.

    `out` may be `acc` itself (in place) when their strides agree: each program loads its tile, then stores it."""
    key = plan_key("ewise", signature, channel_dim, acc, out, aux, *operands)
    plan = _PLANS.get(key)
    if plan is None:
        check_outputs(signature, out, channel_dim, aux, stats)
        plan = _PLANS[key] = _ewise_plan(acc, operands, signature, out, channel_dim)
    if plan is not None:
        acc3 = epi.rows3(acc, acc.shape, channel_dim)
        plan.launch((acc3,), out, operands, signature, out.shape, channel_dim, aux, stats)
    elif stats is not None:
        stats.zero_()
    return out


def _ewise_plan(acc, operands, signature, out, channel_dim) -> Plan | None:
    if out.numel() == 0:
        return None
    acc3, out3 = epi.rows3(acc, acc.shape, channel_dim), epi.rows3(out, out.shape, channel_dim)
    if out3.data_ptr() != out.data_ptr() or any(st == 0 for st in out3.stride()[1:]):
        raise NotImplementedError(f"output strides {out.stride()} are not an [S, P, C] view")
    s, p, c = out3.shape
    paired = epi.paired(epi.parse(signature))  # a GLU's: the accumulator has 2C channels (codegen._pairing)
    n = acc3.shape[-1]
    if acc3.shape[:2] != out3.shape[:2] or n != c * (1 + paired):
        raise ValueError(f"accumulator {tuple(acc.shape)} does not fit the output {tuple(out.shape)}")
    cfg = default_config(c, epi.stats_node(epi.parse(signature)) is not None)
    tiles = triton.cdiv(s * p, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    (a_s, a_p, a_c), (o_s, o_p, o_c) = acc3.stride(), out3.stride()
    kv = channel_vector(c, a_s, a_p, o_s, o_p)
    head = [s * p, n, p, a_s // kv, a_p // kv, a_c, o_s // kv, o_p // kv, o_c]
    meta = dict(BM=cfg.block_m, BN=cfg.block_n, KV=kv, SPLIT_K=1, num_warps=cfg.num_warps)
    boxes = {} if paired else descriptor_operands(signature, operands, out.shape, channel_dim, s * p, c,
                                                  [cfg.block_m, cfg.block_n])
    return Plan(codegen.load(FAMILY, signature, tuple(sorted(boxes))), (tiles, 1, 1), head,
                operand_strides(signature, operands, out.shape, channel_dim), meta,
                (tiles, 1, cfg.block_m, cfg.block_n), out.device, row_blocks=triton.cdiv(s * p, cfg.block_m),
                operand_boxes=boxes)
