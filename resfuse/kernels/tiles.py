"""Shared @triton.jit index helpers for every kernel family's mainloop (no kernels here).

Entry points: `swizzle_tile(pid, tiles_m, tiles_n, GROUP_M)` and `k_range(pid_k, blocks, SPLIT_K)`, called by
gemm.py and conv2d_fprop.py so that both families order their tiles and split their reduction the same way.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def swizzle_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), walking GROUP_M row tiles per column so neighbours share B in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % size_m
    tile_n = (pid % per_group) // size_m
    return tile_m, tile_n


@triton.jit
def k_range(pid_k, blocks, SPLIT_K: tl.constexpr):
    """This split's half-open range of reduction blocks; trailing splits may get an empty range."""
    per_split = tl.cdiv(blocks, SPLIT_K)
    lo = pid_k * per_split
    hi = tl.minimum(lo + per_split, blocks)
    return lo, hi
