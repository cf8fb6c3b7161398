"""GEMM family: the Triton mainloop for [B,] M x K @ K x N, its config space and its heuristic default.

(Named matmul.py, not gemm.py: a submodule `kernels.gemm` would replace the entry-point function of that name.)

Entry points: `gemm_mainloop`, `gemm_tma_mainloop` and `gemm_tma_persistent_mainloop` (@triton.jit, called
by the generated kernels, see codegen.py), `FAMILY`, `TMA_FAMILY` and `PERSISTENT_FAMILY` (what codegen needs
to wrap them), `GemmConfig` (the typed tuning space) and `default_config(problem)`.
A and B may have any strides (row or column major, batch stride 0 for a shared operand). fp32 operands use
tf32 tensor-core products on the GPU (PRECISION="tf32", Triton's default; pass "ieee" for exact fp32); under
the interpreter the product is exact fp32 either way.
"""
from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from .codegen import Family
from .tiles import cdiv, k_range, mma, prefetch_rows, swizzle_tile, tile_offsets


@triton.jit
def gemm_mainloop(a, b, M, N, K, RPS, s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_ob, s_os, s_om,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """One program's fp32 partial product over its split of K, plus the indices the epilogue needs.

    The output may see each batch's M rows as M // RPS samples of RPS rows (a linear layer's [B*S, N]
    product written as [B, S, N]); s_os is the output's sample stride. Plain mm/bmm: RPS = M, s_os = 0.
    """
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m, offs_n, rows, cols, tile_m = tile_offsets(pid, M, N, BM, BN, GROUP_M)
    offs_k = tl.arange(0, BK)
    lo, hi = k_range(pid_k, cdiv(K, BK), SPLIT_K)
    a_ptrs = a + batch * s_ab + rows[:, None] * s_am + (lo * BK + offs_k)[None, :] * s_ak
    b_ptrs = b + batch * s_bb + (lo * BK + offs_k)[:, None] * s_bk + cols[None, :] * s_bn
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for kb in range(lo, hi):
        if EVEN_K:
            a_t = tl.load(a_ptrs)
            b_t = tl.load(b_ptrs)
        else:
            k_ok = kb * BK + offs_k < K
            a_t = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b_t = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = mma(a_t, b_t, acc, PRECISION)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    tile = batch * cdiv(M, BM) * cdiv(N, BN) + pid
    sample = offs_m // RPS
    p_idx = offs_m % RPS
    s_idx = batch * (M // RPS) + sample
    out_rows = batch * s_ob + sample * s_os + p_idx * s_om
    return acc, tile, pid_k, s_idx, p_idx, offs_m < M, out_rows, offs_n, batch * cdiv(M, BM) + tile_m


@triton.jit
def gemm_swapped_prefetch(pid, pid_k, a, M, N, K, s_am, s_ak, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """FAMILY's Family.swap_prefetch. Swapped (launch._swapped_plan), A is the weight of a linear layer or 1x1
    conv, its rows the output's channels: the BM rows of tile `pid` over split pid_k's columns, asked by the first
    column of tiles only (the others read the same rows), where a row's reduction is contiguous as prefetch_rows
    reads it. The plain pointer form prefetches nothing (the TMA families prefetch their B). Without it, the
    swapped 1024 -> 256 conv of ResNet-50 bs1 ran about 3 us slower in the model than the tuner timed it alone,
    where its weight stays in L2 from one call to the next (BENCHMARKS.md, forty-fifth session). What the prefetch
    gains is not established: on an H200 those flipped choices cost +1.9 us a call with prefetching and +0.7 with
    it off everywhere (forty-sixth session), where the H100 had measured +22.9 before it."""
    if s_ak == 1:
        tile_m, tile_n = swizzle_tile(pid, cdiv(M, BM), cdiv(N, BN), GROUP_M)
        if tile_n == 0:
            lo, hi = k_range(pid_k, cdiv(K, BK), SPLIT_K)
            prefetch_rows(a, tile_m * BM, M, s_am, lo * BK, tl.minimum(hi * BK, K), BM)


FAMILY = Family(
    name="gemm", module=__name__, mainloop="gemm_mainloop",
    args=("a", "b", "M", "N", "K", "RPS", "s_ab", "s_am", "s_ak", "s_bb", "s_bk", "s_bn", "s_ob", "s_os", "s_om"),
    constexprs=("BM", "BN", "BK", "GROUP_M", "SPLIT_K", "EVEN_K", "PRECISION"),
    n_cols="N", s_out_c="s_on",
    swap_prefetch="gemm_swapped_prefetch(tl.program_id(0), tl.program_id(2), a, M, N, K, s_am, s_ak, BM, BN, BK, "
                  "GROUP_M, SPLIT_K)",
)


@triton.jit
def gemm_tma_mainloop(a_desc, b_desc, b_mat, M, N, K, RPS, s_os, s_om, s_b,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                      SPLIT_K: tl.constexpr, B_KN: tl.constexpr, PRECISION: tl.constexpr, WS: tl.constexpr):
    """gemm_mainloop for a 2-D A [M, K] and B read through TMA tensor descriptors (Hopper's bulk tile copies):
    no per-element address math, and boxes past an edge read as zeros, so no M, N or K masks. B is [K, N]
    (B_KN) or, for a linear layer's transposed weight, the [N, K] matrix it is a view of. WS: Triton's warp
    specialisation of the loop (producer warps issue the copies, consumer warps the MMAs). b_mat and s_b, the
    matrix b_desc reads and its row stride, are gemm_tma_prefetch's."""
    return gemm_tma_tile(tl.program_id(0), tl.program_id(2), a_desc, b_desc, M, N, K, RPS, s_os, s_om,
                         BM, BN, BK, GROUP_M, SPLIT_K, B_KN, PRECISION, WS)


@triton.jit
def gemm_tma_persistent_mainloop(tile_id, a_desc, b_desc, b_mat, M, N, K, RPS, s_os, s_om, s_b, TILES,
                                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                                 SPLIT_K: tl.constexpr, B_KN: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of gemm_tma_mainloop for a persistent kernel, which walks TILES tiles (codegen's loop): the
    whole reduction, no split."""
    return gemm_tma_tile(tile_id, 0, a_desc, b_desc, M, N, K, RPS, s_os, s_om,
                         BM, BN, BK, GROUP_M, 1, B_KN, PRECISION, False)


@triton.jit
def gemm_tma_tile(pid, pid_k, a_desc, b_desc, M, N, K, RPS, s_os, s_om,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  SPLIT_K: tl.constexpr, B_KN: tl.constexpr, PRECISION: tl.constexpr, WS: tl.constexpr):
    tile_m, tile_n = swizzle_tile(pid, cdiv(M, BM), cdiv(N, BN), GROUP_M)
    lo, hi = k_range(pid_k, cdiv(K, BK), SPLIT_K)
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for kb in tl.range(lo, hi, warp_specialize=WS):
        a_t = a_desc.load([tile_m * BM, kb * BK])
        if B_KN:
            b_t = b_desc.load([kb * BK, tile_n * BN])
        else:
            b_t = tl.trans(b_desc.load([tile_n * BN, kb * BK]))
        acc = mma(a_t, b_t, acc, PRECISION)
    offs_m = tile_m * BM + tl.arange(0, BM)
    offs_n = tile_n * BN + tl.arange(0, BN)
    sample = offs_m // RPS
    p_idx = offs_m % RPS
    return acc, pid, pid_k, sample, p_idx, offs_m < M, sample * s_os + p_idx * s_om, offs_n, tile_m


@triton.jit
def gemm_tma_prefetch(pid, pid_k, b_mat, M, N, K, s_b, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, B_KN: tl.constexpr):
    """The TMA families' Family.prefetch: where B is the [N, K] weight of a linear layer or 1x1 conv, the BN rows
    of tile `pid` over split pid_k's columns, asked by the first row of tiles only (the others read the same rows).
    A [K, N] B (a product of activations) is not prefetched."""
    if not B_KN:
        tile_m, tile_n = swizzle_tile(pid, cdiv(M, BM), cdiv(N, BN), GROUP_M)
        if tile_m == 0:
            lo, hi = k_range(pid_k, cdiv(K, BK), SPLIT_K)
            prefetch_rows(b_mat, tile_n * BN, N, s_b, lo * BK, tl.minimum(hi * BK, K), BN)


@triton.jit
def gemm_tma_origin(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """The first row and column of gemm_tma_tile's tile `tile` (codegen's Family.origin)."""
    tile_m, tile_n = swizzle_tile(tile, cdiv(M, BM), cdiv(N, BN), GROUP_M)
    return tile_m * BM, tile_n * BN


TMA_FAMILY = Family(
    name="gemm_tma", module=__name__, mainloop="gemm_tma_mainloop",
    args=("a_desc", "b_desc", "b_mat", "M", "N", "K", "RPS", "s_os", "s_om", "s_b"),
    constexprs=("BM", "BN", "BK", "GROUP_M", "SPLIT_K", "B_KN", "PRECISION", "WS"),
    n_cols="N", s_out_c="s_on", origin="gemm_tma_origin(tile, M, N, BM, BN, GROUP_M)",
    prefetch="gemm_tma_prefetch(tl.program_id(0), tl.program_id(2), b_mat, M, N, K, s_b, BM, BN, BK, GROUP_M, "
             "SPLIT_K, B_KN)",
)

PERSISTENT_FAMILY = Family(
    name="gemm_tma_persistent", module=__name__, mainloop="gemm_tma_persistent_mainloop",
    args=("a_desc", "b_desc", "b_mat", "M", "N", "K", "RPS", "s_os", "s_om", "s_b", "TILES"),
    constexprs=("BM", "BN", "BK", "GROUP_M", "SPLIT_K", "B_KN", "PRECISION"),
    n_cols="N", s_out_c="s_on", loop="TILES", origin="gemm_tma_origin(tile, M, N, BM, BN, GROUP_M)",
    prefetch="gemm_tma_prefetch(tl.program_id(0), 0, b_mat, M, N, K, s_b, BM, BN, BK, GROUP_M, 1, B_KN)",  # 1st tile
)


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    batch: int
    m: int
    n: int
    k: int
    dtype_bytes: int
    sms: int  # streaming multiprocessors on the device (1 under the interpreter)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One point of the tuning space; `check` says whether it is legal for a problem."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False  # gemm_tma_mainloop; only where launch.tma_operands accepts the operands
    ws: bool = False  # warp-specialise the TMA mainloop's loop (ignored without tma)
    persistent: int = 0  # > 0: PERSISTENT_FAMILY with this many programs an SM, each walking tiles (needs tma)
    tma_store: bool = False  # write the output by bulk stores where launch.descriptor_output accepts it (needs tma)
    swap: bool = False  # compute the transposed output, out^T = B^T A^T (launch._swapped_plan): block_m then tiles
    #                     the output's columns (channels) and block_n its rows; pointer loads, one 2-D product only

    def check(self, p: GemmProblem) -> bool:
        return (tiles_fit(self, p.dtype_bytes) and not (self.tma and p.batch > 1) and not (self.ws and not self.tma)
                and persistent_ok(self) and swap_ok(self, p.batch))


def swap_ok(cfg, samples: int) -> bool:
    """A swapped config (GemmConfig.swap, ConvConfig.swap) runs the pointer mainloop on one sample's product.
    Shared by both families (a 1x1 conv runs as a GEMM)."""
    return not cfg.swap or (samples == 1 and not (cfg.tma or cfg.ws or cfg.persistent or cfg.tma_store))


def persistent_ok(cfg) -> bool:
    """A persistent config runs the TMA tile with the whole reduction: it needs tma, and no split or warp
    specialisation; a bulk store of the output needs tma and no split. Shared by both families (a 1x1 conv runs
    as a GEMM)."""
    return ((cfg.persistent == 0 or (cfg.tma and cfg.split_k == 1 and not cfg.ws))
            and (not cfg.tma_store or (cfg.tma and cfg.split_k == 1)))


def tiles_fit(cfg, dtype_bytes: int) -> bool:
    """A config's tiles suit the hardware: tensor-core minimum sizes, the pipelined A and B tiles in shared
    memory (Hopper: 228 KB a block, some kept back), and a legal warp count. Shared by both families."""
    smem = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * dtype_bytes
    return (min(cfg.block_m, cfg.block_n, cfg.block_k) >= 16 and cfg.split_k >= 1
            and smem <= 220 * 1024 and cfg.num_warps in (2, 4, 8))


SPACE = {  # the tuner (tuning/space.py) enumerates this product and keeps the configs that pass check()
    "block_m": (32, 64, 128, 256), "block_n": (32, 64, 128, 256), "block_k": (32, 64, 128),
    "group_m": (8,), "split_k": (1, 2, 4, 8), "num_warps": (4, 8), "num_stages": (2, 3, 4, 5), "tma": (False, True),
    "ws": (False, True), "persistent": (0, 1, 2), "tma_store": (False, True), "swap": (False, True),
}


def split_k_heuristic(tiles: int, k_blocks: int, sms: int) -> int:
    """Split the reduction when the output tiles fill under half the machine and the reduction is deep.

    Shared by both families: each split keeps at least 4 reduction blocks so the fp32 partial traffic
    (tiles x splits x BM x BN x 8 bytes) stays small next to the operand reads.
    """
    if sms <= 1 or tiles * 2 > sms or k_blocks < 8:
        return 1
    return max(1, min(sms // tiles, k_blocks // 4, 16))


def default_config(p: GemmProblem) -> GemmConfig:
    small = p.m * p.n * p.batch <= 64 * 64
    bm = 32 if p.m <= 32 else 64 if (p.m <= 64 or small) else 128
    bn = 32 if p.n <= 32 else 64 if (p.n <= 64 or small) else 128 if p.dtype_bytes == 4 else 256 if p.m >= 4096 and p.n >= 1024 else 128
    bk = 16 if p.k <= 16 else 32 if (p.k <= 32 or p.dtype_bytes == 4) else 64
    warps = 8 if bm * bn >= 128 * 128 else 4
    stages = 3 if bm * bn >= 128 * 256 else 4
    tiles = p.batch * triton.cdiv(p.m, bm) * triton.cdiv(p.n, bn)
    split = split_k_heuristic(tiles, triton.cdiv(p.k, bk), p.sms)
    return GemmConfig(bm, bn, bk, 8, split, warps, stages)
