"""A classifier's head in one kernel: the global average pool of a 4-D x, then a GEMM and its epilogue.

Entry points: `pooled_gemm(x, b, operands, signature, out, config=None) -> out` (reached through resfuse.kernels,
from ops/pooled.py), `FAMILY` (what codegen needs to wrap the mainloop), `PooledConfig` and `SPACE` (the tuning
space), `default_config(problem)` and `fast_configs(problem)`.

out[n, :] = epilogue(mean over the H x W pixels of x[n, :, :, :] @ b): b is [C, N] (a linear layer's transposed
weight), out [NB, N]. At batch 1 a ResNet's head was two launches, the pool (its [1, 2048, 7, 7] read once) and a
GEMV that streams the 4 MB weight; here each program pools its own stretch of channels, in fp32, rounds the mean to
x's dtype as the pool's output would be, and multiplies it into its columns of b by broadcast products and sums: a
GEMV has too few rows for a tensor-core tile. Every program reads its samples' pixels again (once per column tile),
so the space is for small batches (MAX_BATCH); the tuner times it against the pool and the GEMM as two ops.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .codegen import Family
from .tiles import cdiv, k_range, prefetch_rows

MAX_BATCH = 16  # samples a fused head is offered for: past that the pool's re-reads outweigh its launch


@triton.jit
def pooled_gemm_mainloop(x, b, b_mat, NB, P, W, K, N, s_xn, s_xh, s_xw, s_xk, s_bk, s_bn, s_om,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                         SPLIT_K: tl.constexpr):
    """One program's fp32 partial [BM, BN] over its split of the channels: samples pid(1) * BM.., columns
    pid(0) * BN.., and the indices the epilogue needs (codegen's mainloop convention). b_mat: the prefetch's."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < NB
    col_ok = cols < N
    offs_k = tl.arange(0, BK)
    offs_p = tl.arange(0, BP)
    lo, hi = k_range(pid_k, cdiv(K, BK), SPLIT_K)
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for kb in range(lo, hi):
        ks = kb * BK + offs_k
        k_ok = ks < K
        pooled = tl.full((BM, BK), 0.0, dtype=tl.float32)
        for p0 in range(0, P, BP):
            ps = p0 + offs_p
            pix = (ps // W) * s_xh + (ps % W) * s_xw
            ptrs = x + rows[:, None, None].to(tl.int64) * s_xn + pix[None, :, None] + ks[None, None, :] * s_xk
            ok = row_ok[:, None, None] & (ps < P)[None, :, None] & k_ok[None, None, :]
            pooled += tl.sum(tl.load(ptrs, mask=ok, other=0.0).to(tl.float32), axis=1)
        # the mean as the pool would have stored it, in x's dtype
        mean = (pooled / P).to(x.dtype.element_ty).to(tl.float32)
        w = tl.load(b + ks[:, None] * s_bk + cols[None, :] * s_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(mean[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    # a 2-D output's epilogue view is [1, NB, N] (epilogue.rows3): one sample, the rows its positions
    return acc, pid_m * cdiv(N, BN) + pid_n, pid_k, tl.zeros((BM,), dtype=tl.int32), rows, row_ok, rows * s_om, cols, \
        pid_m


@triton.jit
def pooled_gemm_prefetch(b_mat, K, N, s_bn, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr):
    """Family.prefetch: the program's BN rows of the weight (b's columns, b_mat = b.t()), over its split's channels,
    asked of L2 by the programs of the first samples (the others read the same rows)."""
    if tl.program_id(1) == 0:
        lo, hi = k_range(tl.program_id(2), cdiv(K, BK), SPLIT_K)
        prefetch_rows(b_mat, tl.program_id(0) * BN, N, s_bn, lo * BK, tl.minimum(hi * BK, K), BN)


FAMILY = Family(
    name="pooled_gemm", module=__name__, mainloop="pooled_gemm_mainloop",
    args=("x", "b", "b_mat", "NB", "P", "W", "K", "N", "s_xn", "s_xh", "s_xw", "s_xk", "s_bk", "s_bn", "s_om"),
    constexprs=("BM", "BN", "BK", "BP", "SPLIT_K"),
    n_cols="N", s_out_c="s_on",
    prefetch="pooled_gemm_prefetch(b_mat, K, N, s_bn, BN, BK, SPLIT_K)",
)


@dataclasses.dataclass(frozen=True)
class PooledProblem:
    batch: int
    k: int  # channels
    n: int  # columns
    pixels: int
    dtype_bytes: int
    sms: int


@dataclasses.dataclass(frozen=True)
class PooledConfig:
    block_m: int = 1  # samples a program
    block_n: int = 64
    block_k: int = 64  # channels a step
    block_p: int = 64  # pixels a load
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def check(self, p: PooledProblem) -> bool:
        """Registers: the pixel load [BM, BP, BK] and the product [BM, BK, BN] each within 64 fp32 a thread."""
        per_thread = 64 * 32 * self.num_warps
        return (self.block_m * self.block_p * self.block_k <= per_thread
                and self.block_m * self.block_k * self.block_n <= per_thread and self.split_k >= 1)


SPACE = {
    "block_m": (1, 2, 4), "block_n": (16, 32, 64, 128), "block_k": (16, 32, 64, 128), "block_p": (16, 32, 64),
    "split_k": (1, 2, 4, 8, 16), "num_warps": (4, 8), "num_stages": (1, 2, 3),
}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_config(p: PooledProblem) -> PooledConfig:
    """BM a power of two up to 4 samples, 64 columns and channels; the channels split until the programs fill the
    GPU, each split keeping at least 4 steps."""
    bm = min(4, _pow2(p.batch))
    bp = min(64, _pow2(p.pixels)) // (bm if bm > 1 else 1)
    cfg = PooledConfig(block_m=bm, block_n=64, block_k=64 if bm < 4 else 32, block_p=max(16, bp))
    return dataclasses.replace(cfg, split_k=_split(cfg, p))


def _split(cfg: PooledConfig, p: PooledProblem) -> int:
    tiles = triton.cdiv(p.batch, cfg.block_m) * triton.cdiv(p.n, cfg.block_n)
    steps = triton.cdiv(p.k, cfg.block_k)
    split = 1
    while tiles * split * 2 <= p.sms and steps // (split * 2) >= 4 and split < 16:
        split *= 2
    return split


def fast_configs(p: PooledProblem) -> list[PooledConfig]:
    """The default, and column tiles of 32 and 128 beside its 64, each split for its own count of tiles."""
    default = default_config(p)
    found = [default]
    for bn, bk in ((32, default.block_k), (128, 32), (64, 128 if default.block_m == 1 else 32)):
        cfg = dataclasses.replace(default, block_n=bn, block_k=bk)
        found.append(dataclasses.replace(cfg, split_k=_split(cfg, p)))
    return [c for c in dict.fromkeys(found) if c.check(p)]


def refusal(x: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> str | None:
    """Why the kernel cannot run this head (None: it can)."""
    if x.dim() != 4 or b.dim() != 2 or x.shape[1] != b.shape[0]:
        return f"pool of {tuple(x.shape)} into a product with {tuple(b.shape)}"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or b.dtype != x.dtype:
        return f"{x.dtype} x {b.dtype}"
    if x.shape[0] > MAX_BATCH:
        return f"batch {x.shape[0]} over {MAX_BATCH}: the pool is read once per column tile"
    if out.shape != (x.shape[0], b.shape[1]):
        return f"output {tuple(out.shape)} is not [batch, columns]"
    return None


def pooled_gemm(x: torch.Tensor, b: torch.Tensor, operands, signature: str, out: torch.Tensor,
                config: PooledConfig | None = None) -> torch.Tensor:
    from . import codegen, options
    from .plan import Plan, cached_launch, operand_strides, plan_key, sm_count

    def build():
        if why := refusal(x, b, out):
            raise NotImplementedError(why)
        nb, k, h, w = x.shape
        n = b.shape[1]
        cfg = config or default_config(PooledProblem(nb, k, n, h * w, x.element_size(), sm_count(x.device)))
        split = options()["split_k"] or cfg.split_k
        tiles = triton.cdiv(nb, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        head = [nb, h * w, w, k, n, x.stride(0), x.stride(2), x.stride(3), x.stride(1), b.stride(0), b.stride(1),
                out.stride(0), out.stride(1)]
        meta = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, BP=cfg.block_p, SPLIT_K=split,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        plan = Plan(codegen.load(FAMILY, signature), (triton.cdiv(n, cfg.block_n), triton.cdiv(nb, cfg.block_m),
                    split), head, operand_strides(signature, operands, out.shape, -1), meta,
                    (tiles, split, cfg.block_m, cfg.block_n), out.device, prepare=lambda x, b: (x, b, b.t()))
        if b.stride(0) != 1:  # the prefetch walks the weight's rows: b must be their transposed view
            plan.meta["PREFETCH"] = False
        return plan

    key = plan_key("pooled_gemm", signature, config, options()["split_k"], x, b, out, *operands)
    return cached_launch(key, build, (x, b), out, operands, signature, -1)
