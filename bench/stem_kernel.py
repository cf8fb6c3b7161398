"""A probe, not part of resfuse: a small-channel conv, its epilogue and the max-pool after it, as one Triton kernel
(a CNN's stem: conv 7x7 s2 -> batch norm -> relu -> max-pool 3x3 s2, whose conv output is the largest tensor of
the net). On an H100 and an H200 it ran 1.4x (batch 32) to 1.8x (batch 256) slower than what resfuse runs, cuDNN's
conv and a max-pool that computes the epilogue (BENCHMARKS.md, twenty-seventh session), so no pass puts it in a
graph. bench/stem_pool.py times it, bench/stem_regs.py reads its registers, and tests/kernels/test_stem_probe.py
checks it under the interpreter.

Entry points: `conv2d_max_pool(x, w, operands, signature, stride, padding, dilation, pool, out, config=None)`,
`PoolConfig`, `SPACE`, `fast_configs`.

A persistent program walks TH x TW tiles of pooled outputs of one image and BN output channels. For each it
computes the conv over the box of conv outputs the tile's windows cover ((TH-1)*stride + window rows, likewise
columns: only the windows' overlap at the tile's edges is computed twice), applies the epilogue in fp32, sets the
box's positions outside the conv's output (the pool's padding) to -inf, and takes each window's maximum: one
load per window tap from the program's own scratch slot, which holds the box (a few MB in all, resident in L2),
or one tl.gather of the box per tap (config `gather`, slower). Neither the conv's output nor a padded image is
ever written to memory.

The conv's reduction runs over (r, s, c) flattened, c innermost, in blocks of BK: with C = 3 and a 7x7 filter
that is 147 products in 5 blocks of 32, against 7 x 32 (one block per filter row) or 49 x 16 (per tap). Its
index math is separable: an element's input offset is a row part (the conv position's, [BM]) plus a column part
(the reduction index's, [BK]), so each loaded element costs an add and its bounds checks; the earlier "flat"
mainloop of conv2d_fprop.py, which multiplied out every element's offset, ran the ResNet-50 stem 3.4x slower
than cuDNN. The geometry (C, R, S, strides, paddings) is constexpr, so each column's (r, s, c) is a constant.

Semantics are ATen's max-pool's over the epilogue's fp32 value, rounded once at the store (rounding is monotone,
so this equals pooling the rounded values): a NaN in a window wins, padding never does.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
import triton
import triton.language as tl

from resfuse.kernels.launch import _precision
from resfuse.kernels.plan import pdl_meta, sm_count
from resfuse.kernels.tiles import mma


@triton.jit
def conv_box(x, w, n, ph0, pw0, m0, tile_n, H, W, KO, OH, OW, s_xn, s_xc, s_xh, s_xw, s_wk, s_wc, s_wr, s_ws,
             C: tl.constexpr, R: tl.constexpr, S: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr,
             PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, QSH: tl.constexpr, QSW: tl.constexpr,
             QPH: tl.constexpr, QPW: tl.constexpr, BHC: tl.constexpr, BWC: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, ROWS: tl.constexpr):
    """The fp32 conv outputs of rows m0 .. m0 + BM of the box of the pooled tile whose first output is (ph0, pw0),
    [BM, BN]: row m is conv position (oh0 + m // BWC, ow0 + m % BWC), (oh0, ow0) its first window's first tap, for
    the box's BHC x BWC positions (rows past them are computed on zeros and flagged). Returns the accumulator,
    each row's (oh, ow) and whether it is a position of the conv's output, and the channels. Without MASKED every
    window of the box lies inside the image (the caller checked): the loads are masked along the reduction's
    padding alone, and rows past the box repeat its last position.
    ROWS: x's (w, c) are contiguous (channels_last, no dilation along w), and w is packed as [R, BK, KO] (the
    filter row's S * C products, zero-padded to BK, then the output channels): the reduction runs one filter row
    a block, over which an input row's elements are one contiguous run, and the weight rows are contiguous. The
    compiler then sees both loads' contiguity, and a warp's lanes read neighbouring elements."""
    rows_m = m0 + tl.arange(0, BM)
    m = rows_m if MASKED else tl.minimum(rows_m, BHC * BWC - 1)
    oh = ph0 * QSH - QPH + m // BWC
    ow = pw0 * QSW - QPW + m % BWC
    in_box = (m < BHC * BWC) & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
    ih0 = oh * SH - PH
    iw0 = ow * SW - PW
    rows = ih0 * s_xh + iw0 * s_xw  # within one image: int32 (the launcher checks it fits)
    x_img = x + n.to(tl.int64) * s_xn
    offs_n = tile_n * BN + tl.arange(0, BN)
    w_cols = w + (offs_n % KO) * s_wk
    RED: tl.constexpr = R * S
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    if ROWS:
        jj = tl.arange(0, BK)
        j_ok = jj < S * C
        iw = iw0[:, None] + (jj // C)[None, :]
        w_ok = (iw >= 0) & (iw < W)
        for r in tl.static_range(R):
            ih = ih0 + r * DH
            if MASKED:
                ok = ((in_box & (ih >= 0) & (ih < H))[:, None] & j_ok[None, :]) & w_ok
            else:
                ok = j_ok[None, :]
            x_t = tl.load(x_img + (rows + r * DH * s_xh)[:, None] + jj[None, :], mask=ok, other=0.0)
            w_t = tl.load(w + (r * BK + jj)[:, None] * KO + (offs_n % KO)[None, :])
            acc = mma(x_t, w_t, acc, PRECISION)
    else:
        for kb in tl.static_range((RED * C + BK - 1) // BK):  # the geometry is constexpr: so is each column's index
            j = kb * BK + tl.arange(0, BK)
            c = j % C
            rs = j // C
            r = rs // S
            s = rs % S
            j_ok = rs < RED
            ih = ih0[:, None] + (r * DH)[None, :]
            iw = iw0[:, None] + (s * DW)[None, :]
            if MASKED:
                ok = (in_box[:, None] & j_ok[None, :]) & ((ih >= 0) & (ih < H)) & ((iw >= 0) & (iw < W))
            else:
                ok = j_ok[None, :]
            x_t = tl.load(x_img + rows[:, None] + (r * DH * s_xh + s * DW * s_xw + c * s_xc)[None, :], mask=ok,
                          other=0.0)
            w_t = tl.load(w_cols[None, :] + (r * s_wr + s * s_ws + c * s_wc)[:, None], mask=j_ok[:, None],
                          other=0.0)
            acc = mma(x_t, w_t, acc, PRECISION)
    if not MASKED:
        in_box = rows_m < BHC * BWC
    return acc, oh, ow, in_box, offs_n


@triton.jit
def pool_box(y, scratch, ph0, pw0, TH: tl.constexpr, TW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
             QSH: tl.constexpr, QSW: tl.constexpr, QDH: tl.constexpr, QDW: tl.constexpr, BWC: tl.constexpr,
             BP: tl.constexpr, BN: tl.constexpr, GATHER: tl.constexpr):
    """Max-pool the box's values (-inf where the box leaves the conv's output) into the tile's [BP, BN] pooled
    outputs, pooled position p = (ph0 + p // TW, pw0 + p % TW); also returns (ph, pw) and which p are the
    tile's. GATHER: each window tap is a tl.gather of the box's [BM, BN] values y; else one load from `scratch`,
    this program's slot, which holds them (row-major [BM, BN], written by this program alone)."""
    p = tl.arange(0, BP)
    i = p // TW
    jj = p % TW
    cols = tl.arange(0, BN)
    best = tl.full((BP, BN), float("-inf"), dtype=tl.float32)
    for a in tl.static_range(KH):
        for b in tl.static_range(KW):
            at = (i * QSH + a * QDH) * BWC + jj * QSW + b * QDW
            at = tl.where(p < TH * TW, at, 0)
            if GATHER:
                v = tl.gather(y, tl.broadcast_to(at[:, None], (BP, BN)), 0)
            else:
                v = tl.load(scratch + at[:, None] * BN + cols[None, :]).to(tl.float32)
            best = tl.where((v > best) | (v != v), v, best)
    return best, ph0 + i, pw0 + jj, p < TH * TW


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """One point of the tuning space: pooled tile rows x columns, output channels and reduction block per
    program, warps and pipeline stages."""
    tile_h: int = 7
    tile_w: int = 7
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 2
    gather: bool = False  # pool with tl.gather in registers, else through an L2-resident scratch slot
    programs: int = 2  # persistent programs an SM (each walks tiles program_id, program_id + programs, ...)
    splits: int = 1  # the box's conv in this many blocks of rows, each stored to the scratch slot (not with gather)
    rows: bool = False  # one filter row a reduction block (conv_box's ROWS), where x's layout allows it: slower

    def box(self, pool) -> tuple[int, int, int]:
        """(rows, columns, BM): the conv positions the tile's windows cover, and BM, their count's power of 2."""
        (kh, kw), (sh, sw), _, (dh, dw) = pool[:4]
        bh = (self.tile_h - 1) * sh + (kh - 1) * dh + 1
        bw = (self.tile_w - 1) * sw + (kw - 1) * dw + 1
        return bh, bw, triton.next_power_of_2(bh * bw)

    def check(self, pool) -> bool:
        """Registers: each [BM / splits, BN] block of the box and the [BP, BN] pool, with room for the loads."""
        bm = self.box(pool)[2]
        return (16 * self.splits <= bm and bm * self.block_n <= 512 * 64 * self.splits and self.block_k >= 16
                and not (self.gather and self.splits > 1))


SPACE = {"tile_h": (3, 5, 7), "tile_w": (5, 7, 15), "block_n": (64,), "block_k": (32, 64), "num_warps": (4, 8),
         "num_stages": (1, 2), "gather": (False,), "programs": (1, 2, 4)}


def default_config(k: int) -> PoolConfig:
    return PoolConfig(block_n=min(64, max(16, triton.next_power_of_2(k))))


def fast_configs(k: int) -> list[PoolConfig]:
    """The default and a few tiles around it."""
    d = default_config(k)
    r = dataclasses.replace
    return list(dict.fromkeys([d, r(d, rows=True), r(d, num_warps=4), r(d, splits=2), r(d, splits=2, num_warps=4),
                               r(d, programs=1), r(d, num_stages=3), r(d, tile_h=5, tile_w=5),
                               r(d, tile_w=15, splits=2), r(d, tile_w=15, splits=4, num_warps=4)]))


def kernel_source(signature: str) -> str:
    from resfuse import epilogue as epi
    from resfuse.kernels.epilogue_source import triton_body, triton_params
    from resfuse.kernels.activations import HELPERS

    tree = epi.parse(signature)
    consts = ("C", "R", "S", "SH", "SW", "PH", "PW", "DH", "DW", "KH", "KW", "QSH", "QSW", "QPH", "QPW", "QDH", "QDW",
              "TH", "TW", "BHC", "BWC", "BM", "BMS", "SPLITS", "BP", "BN", "BK", "GATHER", "ROWS", "PRECISION", "PDL")
    params = ["x", "w", "out", "scratch", "NB", "H", "W", "KO", "OH", "OW", "POH", "POW", "s_xn", "s_xc", "s_xh",
              "s_xw", "s_wk", "s_wc", "s_wr", "s_ws", "s_on", "s_oc", "s_oh", "s_ow", *triton_params(tree),
              *[f"{c}: tl.constexpr" for c in consts]]
    body = "\n".join("            " + line for line in triton_body(tree, out="y").splitlines())
    param_lines = "".join(f"    {p},\n" for p in params)
    return f'''"""Generated by bench/stem_kernel.py; do not edit.

Conv, epilogue, max-pool: {signature}
"""
import triton
import triton.language as tl

from resfuse.kernels.activations import {", ".join(HELPERS)}
from stem_kernel import conv_box, pool_box  # bench/ is on sys.path (bench/stem_pool.py, the tests)
from resfuse.kernels.tiles import cdiv, dependent_launch


@triton.jit
def resfuse_stem_probe(
{param_lines}):
    dependent_launch(PDL)
    tiles_w = cdiv(POW, TW)
    tiles_h = cdiv(POH, TH)
    slot = scratch + (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)) * (BM * BN)
    for tile in range(tl.program_id(0), NB * tiles_h * tiles_w, tl.num_programs(0)):
        n = tile // (tiles_h * tiles_w)
        ph0 = tile // tiles_w % tiles_h * TH
        pw0 = tile % tiles_w * TW
        oh0 = ph0 * QSH - QPH
        ow0 = pw0 * QSW - QPW
        inside = ((oh0 >= 0) & (oh0 + BHC <= OH) & (oh0 * SH - PH >= 0)
                  & ((oh0 + BHC - 1) * SH - PH + (R - 1) * DH < H)
                  & (ow0 >= 0) & (ow0 + BWC <= OW) & (ow0 * SW - PW >= 0)
                  & ((ow0 + BWC - 1) * SW - PW + (S - 1) * DW < W))
        if not GATHER:
            tl.debug_barrier()  # the slot's readers (the previous tile's pool) are done
        for sb in tl.static_range(SPLITS):  # the box in SPLITS blocks of BMS rows: fewer registers live
            if inside:
                acc, oh, ow, in_box, offs_c = conv_box(
                    x, w, n, ph0, pw0, sb * BMS, tl.program_id(1), H, W, KO, OH, OW, s_xn, s_xc, s_xh, s_xw, s_wk,
                    s_wc, s_wr, s_ws, C, R, S, SH, SW, PH, PW, DH, DW, QSH, QSW, QPH, QPW, BHC, BWC, BMS, BN, BK,
                    PRECISION, False, ROWS)
            else:
                acc, oh, ow, in_box, offs_c = conv_box(
                    x, w, n, ph0, pw0, sb * BMS, tl.program_id(1), H, W, KO, OH, OW, s_xn, s_xc, s_xh, s_xw, s_wk,
                    s_wc, s_wr, s_ws, C, R, S, SH, SW, PH, PW, DH, DW, QSH, QSW, QPH, QPW, BHC, BWC, BMS, BN, BK,
                    PRECISION, True, ROWS)
            mask_c = offs_c < KO
            mask = in_box[:, None] & mask_c[None, :]
            s_idx = tl.full((BMS,), 0, tl.int32) + n
            p_idx = oh * OW + ow
{body}
            # rounded to the output's dtype before the max, which rounding commutes with (it is monotone)
            y = tl.where(in_box[:, None], y, float("-inf")).to(slot.dtype.element_ty)
            if not GATHER:
                tl.store(slot + (sb * BMS + tl.arange(0, BMS))[:, None] * BN + tl.arange(0, BN)[None, :], y)
        if not GATHER:
            tl.debug_barrier()  # every row of the box is written before any is read
        best, ph, pw, p_ok = pool_box(y, slot, ph0, pw0, TH, TW, KH, KW, QSH, QSW, QDH, QDW, BWC, BP, BN, GATHER)
        ok = (p_ok & (ph < POH) & (pw < POW))[:, None] & mask_c[None, :]
        rows = n.to(tl.int64) * s_on + ph * s_oh + pw * s_ow
        tl.store(out + rows[:, None] + (offs_c * s_oc)[None, :], best.to(out.dtype.element_ty), mask=ok)
'''


def _fits_int32(t: torch.Tensor) -> bool:
    """Does an offset within one sample fit int32?"""
    return sum((d - 1) * abs(st) for d, st in zip(t.shape[1:], t.stride()[1:])) < 2**31 - 1


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(out: torch.Tensor, numel: int) -> torch.Tensor:
    """The programs' scratch slots, in the output's dtype: one buffer per device and dtype, grown as needed (a few
    MB: it stays in L2). A
    probe's shortcut: growing it would strand a CUDA graph captured with the old one."""
    key = (out.device, out.dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=out.dtype, device=out.device)
    return buf


_PACKED: dict[tuple, tuple] = {}


def _packed(w: torch.Tensor, bk: int) -> torch.Tensor:
    """w [K, C, R, S] as [R, bk, K], contiguous: each filter row's S * C products (s, then c), zero-padded to bk,
    then the output channels. Kept while w itself (not just a tensor at its address) keeps its version, so the
    probe's timings leave the packing out."""
    key = (w.data_ptr(), tuple(w.shape), w.dtype, bk)
    found = _PACKED.get(key)
    if found is None or found[0]() is not w or found[1] != w._version:
        k, c, r, s = w.shape
        packed = torch.zeros(r, bk, k, dtype=w.dtype, device=w.device)
        packed[:, : s * c] = w.permute(2, 3, 1, 0).reshape(r, s * c, k)
        found = _PACKED[key] = (weakref.ref(w), w._version, packed)
    return found[2]


def conv2d_max_pool(x: torch.Tensor, w: torch.Tensor, operands, signature: str, stride, padding, dilation, pool,
                    out: torch.Tensor, config: PoolConfig | None = None) -> torch.Tensor:
    """out = max_pool2d(epilogue(conv2d(x, w)), *pool), pool = (kernel, stride, padding, dilation, ceil_mode).
    The epilogue's operands are per channel or per (sample, channel): none as large as the conv's output."""
    from resfuse import epilogue as epi
    from resfuse.kernels.codegen import load_source

    n, c, h, wd = x.shape
    k, _, r, s = w.shape
    oh = (h + 2 * padding[0] - dilation[0] * (r - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (s - 1) - 1) // stride[1] + 1
    poh, pow_ = out.shape[2:]
    if not out.numel():
        return out
    if not (_fits_int32(x) and _fits_int32(out)):
        raise ValueError("conv2d_max_pool: one sample's offsets pass int32")
    config = config or default_config(k)
    (kh, kw), (qsh, qsw), (qph, qpw), (qdh, qdw) = pool[:4]
    bhc, bwc, bm = config.box(pool)
    tree = epi.parse(signature)
    conv_shape = (n, k, oh, ow)
    op_args = [a for v in epi.operand_views(tree, operands, conv_shape, 1) for a in (v, *v.stride())]
    run = load_source("stem_probe", signature, lambda: kernel_source(signature))
    rows = config.rows and x.stride(1) == 1 and x.stride(3) == c and dilation[1] == 1
    bk = triton.next_power_of_2(max(16, s * c)) if rows else config.block_k
    w_arg = _packed(w, bk) if rows else w
    tiles = n * triton.cdiv(poh, config.tile_h) * triton.cdiv(pow_, config.tile_w)
    grid = (min(tiles, sm_count(x.device) * config.programs), triton.cdiv(k, config.block_n))
    scratch = _scratch(out, 1 if config.gather else grid[0] * grid[1] * bm * config.block_n)
    run[grid](x, w_arg, out, scratch, n, h, wd, k, oh, ow, poh, pow_, *x.stride(), *w.stride(), *out.stride(), *op_args,
              C=c, R=r, S=s, SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1], DH=dilation[0], DW=dilation[1],
              KH=kh, KW=kw, QSH=qsh, QSW=qsw, QPH=qph, QPW=qpw, QDH=qdh, QDW=qdw, TH=config.tile_h,
              TW=config.tile_w, BHC=bhc, BWC=bwc, BM=bm, BMS=bm // config.splits, SPLITS=config.splits,
              BP=triton.next_power_of_2(config.tile_h * config.tile_w),
              BN=config.block_n, BK=bk, GATHER=config.gather, ROWS=rows, PRECISION=_precision(x.dtype),
              num_warps=config.num_warps, num_stages=config.num_stages, **pdl_meta(x.device))
    return out
