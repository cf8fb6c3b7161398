"""Shared @triton.jit index helpers for every kernel family's mainloop (no kernels here).

Entry points: `swizzle_tile(pid, tiles_m, tiles_n, GROUP_M)`, `k_range(pid_k, blocks, SPLIT_K)`, `mma` and `cdiv`,
called by matmul.py and conv2d_fprop.py so that both families order their tiles and split their reduction the
same way; `dependent_launch(PDL)`, every kernel's first statement (programmatic dependent launch), after
`prefetch_rows`, a family's L2 prefetch of its weight tile where it has one (codegen.Family.prefetch).

Kernels here use Triton builtins only, never triton.language.standard's @jit helpers (tl.cdiv, tl.sum, and
since triton 3.7 tl.zeros: use tl.full): those are decorated when triton is first imported, so if that
happened before the interpreter switch they would stay compiled-mode functions and fail inside an interpreted
kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

try:  # griddepcontrol (programmatic dependent launch), Hopper and later; plan.pdl_meta checks for it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older triton: PDL stays off, and the kernels' `if PDL:` branch is compiled out
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def dependent_launch(PDL: tl.constexpr):
    """A kernel's first statement. Under programmatic dependent launch (plan.pdl_meta) its programs may start
    while the previous kernel drains: wait for that kernel, its writes visible, before any load or store (it
    may still read the buffer this kernel writes), then let the next kernel's programs launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_rows(base, row0, n_rows, row_stride, k0, k1, ROWS: tl.constexpr):
    """Ask L2 for elements [k0, k1) of rows row0 .. row0 + ROWS - 1 (those < n_rows) of the matrix at `base`
    (rows `row_stride` elements apart): one bulk prefetch a row (Hopper's cp.async.bulk.prefetch.L2), widened
    to 16-byte bounds. A hint: nothing waits for it or reads it into registers. A kernel issues it for its
    weight tile before it waits for the previous kernel (dependent_launch): under programmatic dependent launch
    the weights then stream from DRAM while that kernel runs, and its loads meet L2 (a few tenths of a us a conv at
    ResNet-50 bs1 on an H100: BENCHMARKS.md, forty-second session). Compiled only (the interpreter has no PTX)."""
    lo, size = prefetch_bounds(base, row0, n_rows, row_stride, k0, k1, ROWS)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2;"
                              " mov.u32 $0, 0; }", "=r,l,r", [lo, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_bounds(base, row0, n_rows, row_stride, k0, k1, ROWS: tl.constexpr):
    """prefetch_rows' bulk prefetches: each row's first byte address and byte count, 16-byte aligned and covering
    its elements [k0, k1); a count of 0 for a row past n_rows or an empty range."""
    rows = row0 + tl.arange(0, ROWS)
    start = (base + rows.to(tl.int64) * row_stride + k0).to(tl.int64)
    end = start + (k1 - k0) * (base.dtype.element_ty.primitive_bitwidth // 8)
    lo = start & -16
    size = tl.where((rows < n_rows) & (k1 > k0), ((end + 15) & -16) - lo, 0).to(tl.int32)
    return lo, size


@triton.jit
def cdiv(a, b):
    return (a + b - 1) // b


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
def tile_offsets(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile of an M x N problem: its row and column offsets, the same wrapped into
    range, and its tile row. Edge rows and columns wrap onto valid ones so the mainloop's loads need no M/N mask;
    their results are masked at the store. (No contiguity hints on the wrapped indices: a wrap inside a vector
    would read past the edge.)"""
    tile_m, tile_n = swizzle_tile(pid, cdiv(M, BM), cdiv(N, BN), GROUP_M)
    offs_m = tile_m * BM + tl.arange(0, BM)
    offs_n = tile_n * BN + tl.arange(0, BN)
    return offs_m, offs_n, offs_m % M, offs_n % N, tile_m


@triton.jit
def k_range(pid_k, blocks, SPLIT_K: tl.constexpr):
    """This split's half-open range of reduction blocks; trailing splits may get an empty range."""
    per_split = cdiv(blocks, SPLIT_K)
    lo = pid_k * per_split
    hi = tl.minimum(lo + per_split, blocks)
    return lo, hi


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """acc += a @ b. PRECISION is tl.dot's input_precision, or "upcast": Triton's interpreter multiplies
    bf16 tiles as raw integers (np.matmul on their bits), so there both tiles go to fp32 first; bf16 x bf16
    products are exact in fp32, so the result is what the tensor cores compute."""
    if PRECISION == "upcast":
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc
