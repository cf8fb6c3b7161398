"""Depthwise conv2d forward family: a direct Triton mainloop, its config space and its heuristic default.

Entry points: `conv2d_depthwise_mainloop` (@triton.jit, called by the generated kernels, see codegen.py),
`FAMILY`, `is_depthwise(x_shape, w_shape)`, `pixel_alignment(x)`, `DepthwiseConfig` (the typed tuning space),
`fast_configs(default, problem)` and `default_config(problem)`.

Depthwise means groups = C: the weight is [K, 1, R, S] with K a multiple of C, and output channel k reads
input channel k // (K / C) alone (MobileNet's, EfficientNet's and ConvNeXt's 3x3 to 7x7 convs). There is no
reduction across channels, so no GEMM and no tensor cores: rows are output pixels (n, oh, ow), columns are
output channels, and for each tap (r, s) the program loads one shifted [BM pixels, BN channels] input tile,
contiguous along the channels in channels_last, and multiplies it by the tap's [BN] weights in fp32. A tile's
pixels are a box of one image, so the taps of one program reread a small patch of input (the box and its
halo), which L1 serves.

That per-tap loop spends a load, a convert and a mask on every FMA. Where the width has stride and dilation 1
and at most 7 taps, the strip mainloop (`_strip_taps`, config `strip`) computes strips of 4 or 8 neighbouring
outputs along the width in as many accumulators: each input column of a row of taps is loaded and converted
once and feeds up to S FMAs, one into each output of the strip it reaches.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import triton
import triton.language as tl

from .codegen import Family
from .conv2d_fprop import ConvProblem
from .tiles import cdiv


def pixel_alignment(x: torch.Tensor) -> int:
    """The largest of 8, 4, 2, 1 elements that divides the input's sample, row and column strides (VEC)."""
    s_n, _, s_h, s_w = x.stride()
    return next(v for v in (8, 4, 2, 1) if s_n % v == s_h % v == s_w % v == 0)


def is_depthwise(x_shape: Sequence[int], w_shape: Sequence[int]) -> bool:
    """groups = C > 1 (the weight has one input channel per group), each input channel feeding K / C outputs."""
    return (len(x_shape) == len(w_shape) == 4 and w_shape[1] == 1 and x_shape[1] > 1
            and w_shape[0] % x_shape[1] == 0)


@triton.jit
def _per_tap(x_rows, x_cols, w_cols, k_ok, oh, ow, row_ok, H, W, R, s_xh, s_xw, s_wr, s_ws, stride_h, stride_w,
             pad_h, pad_w, dil_h, dil_w, BM: tl.constexpr, BN: tl.constexpr, S: tl.constexpr, VEC: tl.constexpr):
    """The per-tap loop's accumulator: for each tap, one shifted [BM, BN] input tile times the tap's weights. The
    R rows of taps loop; the S taps of a row unroll (S is constexpr), so a row's loads are in flight together."""
    ih0 = oh * stride_h - pad_h
    iw0 = ow * stride_w - pad_w
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for r in range(R):
        ih = ih0 + r * dil_h
        h_ok = row_ok & (ih >= 0) & (ih < H)
        x_r = x_rows + ih * (s_xh * VEC)
        w_r = w_cols + r * s_wr
        for s in tl.static_range(S):
            iw = iw0 + s * dil_w
            ok = h_ok & (iw >= 0) & (iw < W)
            x_t = tl.load((x_r + iw * (s_xw * VEC))[:, None] + x_cols[None, :],
                          mask=ok[:, None] & k_ok[None, :], other=0.0)
            w_t = tl.load(w_r + s * s_ws, mask=k_ok, other=0.0)
            acc += x_t.to(tl.float32) * w_t.to(tl.float32)[None, :]
    return acc


@triton.jit
def _tap(acc, x, taps, s: tl.constexpr, S: tl.constexpr):
    """acc + x * taps[s]: input column x feeds this strip output through tap s, if s is one (0 <= s < S); taps is
    the row's tuple of tap weights, indexed at compile time."""
    if s >= 0 and s < S:
        acc += x * taps[s]
    return acc


@triton.jit
def _tap_weight(w_r, k: tl.constexpr, s_ws, k_ok, S: tl.constexpr):
    """Tap k's [1, BN] fp32 weights of the row at w_r, or zeros past the kernel's S taps (never used then)."""
    if k < S:
        return tl.load(w_r + k * s_ws, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    return tl.full(k_ok.shape, 0.0, tl.float32)[None, :]


@triton.jit
def _strip_taps(x_rows, x_cols, w_cols, k_ok, oh, ow, row_ok, H, W, R, s_xh, s_xw, s_wr, s_ws,
                stride_h, pad_h, pad_w, dil_h, BMS: tl.constexpr, BN: tl.constexpr, S: tl.constexpr,
                VEC: tl.constexpr, WS: tl.constexpr):
    """The strip mainloop's accumulators: row j of accumulator i is output pixel (oh[j], ow[j] + i), a strip of
    WS (4 or 8) neighbours along the width. Each input column of a row of taps is loaded and converted once and
    multiplied into every strip output it feeds, S FMAs a load, where the per-tap loop spends a load, a convert
    and a mask per FMA (its instruction issue bounds it: BENCHMARKS.md, sixth session). Stride and dilation 1
    along the width only, at most 7 taps."""
    acc0 = tl.full((BMS, BN), 0.0, tl.float32)
    acc1 = tl.full((BMS, BN), 0.0, tl.float32)
    acc2 = tl.full((BMS, BN), 0.0, tl.float32)
    acc3 = tl.full((BMS, BN), 0.0, tl.float32)
    acc4 = tl.full((BMS, BN), 0.0, tl.float32)
    acc5 = tl.full((BMS, BN), 0.0, tl.float32)
    acc6 = tl.full((BMS, BN), 0.0, tl.float32)
    acc7 = tl.full((BMS, BN), 0.0, tl.float32)
    ih0 = oh * stride_h - pad_h
    iw0 = ow - pad_w
    for r in range(R):
        ih = ih0 + r * dil_h
        h_ok = row_ok & (ih >= 0) & (ih < H)
        x_r = x_rows + ih * (s_xh * VEC)
        w_r = w_cols + r * s_wr
        taps = (_tap_weight(w_r, 0, s_ws, k_ok, S), _tap_weight(w_r, 1, s_ws, k_ok, S),
                _tap_weight(w_r, 2, s_ws, k_ok, S), _tap_weight(w_r, 3, s_ws, k_ok, S),
                _tap_weight(w_r, 4, s_ws, k_ok, S), _tap_weight(w_r, 5, s_ws, k_ok, S),
                _tap_weight(w_r, 6, s_ws, k_ok, S))
        for j in tl.static_range(WS + S - 1):
            iw = iw0 + j
            ok = h_ok & (iw >= 0) & (iw < W)
            xj = tl.load((x_r + iw * (s_xw * VEC))[:, None] + x_cols[None, :], mask=ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
            acc0 = _tap(acc0, xj, taps, j, S)
            acc1 = _tap(acc1, xj, taps, j - 1, S)
            acc2 = _tap(acc2, xj, taps, j - 2, S)
            acc3 = _tap(acc3, xj, taps, j - 3, S)
            if WS > 4:
                acc4 = _tap(acc4, xj, taps, j - 4, S)
                acc5 = _tap(acc5, xj, taps, j - 5, S)
                acc6 = _tap(acc6, xj, taps, j - 6, S)
                acc7 = _tap(acc7, xj, taps, j - 7, S)
    # one [WS * BMS, BN] tile whose row i * BMS + j is accumulator i's row j: joined pairwise (the lowest bit of
    # i innermost), the join axes moved in front of the rows, highest bit first
    quad = tl.join(tl.join(acc0, acc1), tl.join(acc2, acc3))
    if WS > 4:
        both = tl.join(quad, tl.join(tl.join(acc4, acc5), tl.join(acc6, acc7)))
        tile = tl.reshape(tl.permute(both, (4, 3, 2, 0, 1)), (8 * BMS, BN))
    else:
        tile = tl.reshape(tl.permute(quad, (3, 2, 0, 1)), (4 * BMS, BN))
    return tile


@triton.jit
def conv2d_depthwise_mainloop(x, w, NB, H, W, C, KO, OH, OW, R, MULT,
                              s_xn, s_xc, s_xh, s_xw, s_wk, s_wr, s_ws, s_on, s_oh, s_ow,
                              stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                              BM: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
                              S: tl.constexpr, VEC: tl.constexpr, WS: tl.constexpr, KV: tl.constexpr,
                              SPLIT_K: tl.constexpr):
    """One program's fp32 [BM, BN] outputs, plus the indices the epilogue needs: from the strip mainloop
    (`_strip_taps`, WS > 0), whose tile rows are ordered strip position first, or the per-tap loop (`_per_tap`).
    The input's pixel strides come divided by VEC, their common alignment in elements, and the output's pixel
    strides divided by KV, which also divides the channel count KO: Triton knows only 16-divisible arguments, and
    MobileNet's 72 or 120 channels would otherwise read and write 2 bytes at a time. For the same reason the
    channel mask compares channel groups of KV (`offs_k // KV < KO // KV`, codegen's Family.col_vec)."""
    pid = tl.program_id(0)
    tiles_w = cdiv(OW, BW)
    tiles_hw = cdiv(OH, BH) * tiles_w
    tiles_m = NB * tiles_hw
    # a tile is a BH x BW box of one image's output pixels (its inputs, halo included, stay in L1 for all taps);
    # neighbouring programs take neighbouring boxes of one channel block, so they share halo rows in L2
    tile_m = pid % tiles_m
    i = tl.arange(0, BM)
    n_i = tl.full((BM,), tile_m // tiles_hw, dtype=tl.int32)
    oh0 = (tile_m % tiles_hw) // tiles_w * BH
    ow0 = (tile_m % tiles_w) * BW
    offs_k = (pid // tiles_m) * BN + tl.arange(0, BN)
    k_ok = offs_k // KV < KO // KV  # offs_k < KO, in whole vectors of KV channels
    x_cols = (offs_k // MULT) * s_xc
    w_cols = w + offs_k * s_wk
    if WS > 0:
        BMS: tl.constexpr = BM // WS
        j = tl.arange(0, BMS)  # a strip: its first pixel's box row and column
        oh_s = oh0 + j // (BW // WS)
        ow_s = ow0 + j % (BW // WS) * WS
        x_rows_s = x + tl.full((BMS,), tile_m // tiles_hw, dtype=tl.int32) * (s_xn * VEC)
        acc = _strip_taps(x_rows_s, x_cols, w_cols, k_ok, oh_s, ow_s, (oh_s < OH) & (ow_s < OW), H, W, R, s_xh,
                          s_xw, s_wr, s_ws, stride_h, pad_h, pad_w, dil_h, BMS, BN, S, VEC, WS)
        oh = oh0 + i % BMS // (BW // WS)
        ow = ow0 + i % BMS % (BW // WS) * WS + i // BMS
    else:
        oh = oh0 + i // BW
        ow = ow0 + i % BW
        acc = _per_tap(x + n_i * (s_xn * VEC), x_cols, w_cols, k_ok, oh, ow, (oh < OH) & (ow < OW), H, W, R, s_xh,
                       s_xw, s_wr, s_ws, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, BM, BN, S, VEC)
    row_ok = (oh < OH) & (ow < OW)
    p_i = oh * OW + ow
    out_rows = (n_i * s_on + oh * s_oh + ow * s_ow) * KV
    return acc, pid, 0, n_i, p_i, row_ok, out_rows, offs_k, tile_m


FAMILY = Family(
    name="conv2d_depthwise", module=__name__, mainloop="conv2d_depthwise_mainloop",
    args=("x", "w", "NB", "H", "W", "C", "KO", "OH", "OW", "R", "MULT",
          "s_xn", "s_xc", "s_xh", "s_xw", "s_wk", "s_wr", "s_ws", "s_on", "s_oh", "s_ow",
          "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w"),
    constexprs=("BM", "BN", "BH", "BW", "S", "VEC", "WS", "KV", "SPLIT_K"),
    n_cols="KO", s_out_c="s_ok", col_vec="KV",
)


STRIP_TAPS = 7  # the most taps a row that _strip_taps takes: a row's weights are a tuple of 7


def strip_applies(p: ConvProblem) -> bool:
    """The strip mainloop's loads serve neighbours along the width: stride and dilation 1 there, at most 7 taps."""
    return p.unit_w and p.s <= STRIP_TAPS


@dataclasses.dataclass(frozen=True)
class DepthwiseConfig:
    """One point of the tuning space; `check` says whether it is legal for a problem."""
    block_h: int = 8  # the tile's box of output pixels, block_h x block_w
    block_w: int = 8
    block_n: int = 32  # channels
    num_warps: int = 4
    strip: int = 0  # 0: the per-tap loop; 4 or 8: the strip mainloop (stride and dilation 1 along the width)

    @property
    def block_m(self) -> int:
        return self.block_h * self.block_w

    def check(self, p: ConvProblem) -> bool:
        # the fp32 accumulator and a row of taps' input tiles in flight stay in registers
        return (self.block_m * self.block_n <= 64 * 32 * self.num_warps and self.block_n <= max(16, 2 * p.k)
                and self.block_h <= max(1, 2 * p.oh) and self.block_w <= max(1, 2 * p.ow)
                and (self.strip == 0 or (strip_applies(p) and self.block_w % self.strip == 0)))


SPACE = {  # the tuner (tuning/space.py) enumerates this product and keeps the configs that pass check()
    "block_h": (1, 2, 4, 8, 16), "block_w": (4, 8, 16, 32, 64), "block_n": (16, 32, 64, 128),
    "num_warps": (2, 4, 8), "strip": (0, 4, 8),
}


def fast_configs(default: DepthwiseConfig, p: ConvProblem) -> list[DepthwiseConfig]:
    """The "fast" level: the default and the tiles that won somewhere among the zoo's depthwise shapes at batch 32
    and 256 (bench/depthwise.py): the strip mainloop's where it applies (twenty-eighth session, H200: 1.1-1.7x
    cuDNN + our epilogue on ConvNeXt's 7x7 convs, 2-2.9x the per-tap loop), else the per-tap loop's (sixth
    session, H100)."""
    strips = ((4, 16, 32, 2, 8), (4, 32, 32, 2, 8), (8, 8, 32, 1, 8), (8, 8, 64, 2, 8), (2, 32, 32, 2, 8),
              (8, 16, 32, 2, 8))
    taps = ((8, 8, 32, 4), (4, 8, 32, 2), (4, 16, 32, 4), (4, 8, 64, 4), (1, 64, 32, 4))
    tiles = [c for c in (DepthwiseConfig(*t) for t in strips) if c.check(p)]
    return list(dict.fromkeys([default, *(tiles or [DepthwiseConfig(*t) for t in taps])]))


def default_config(p: ConvProblem) -> DepthwiseConfig:
    """Where the strip mainloop applies (stride and dilation 1 along the width, at most 7 taps, 4 or more output
    columns): a 4 x 16 box in strips of 8 (8 x 8 for images 8 wide or less), 64 bytes of channels a pixel (128
    from 64 channels on in the 8 x 8 box), two warps. Else an 8 x 8 box (or the image, when smaller) of 64 bytes
    of channels a pixel for the per-tap loop."""
    bn = 16 if p.k <= 16 else 32
    if strip_applies(p) and p.ow >= 4:
        bh, bw = (4, 16) if p.ow > 8 else (8, 8)
        bn = 64 if bw == 8 and p.k >= 64 else bn
        return DepthwiseConfig(min(bh, triton.next_power_of_2(p.oh)), bw, bn, 2, strip=8)
    bh = min(8, triton.next_power_of_2(p.oh))
    bw = min(8, triton.next_power_of_2(p.ow))
    return DepthwiseConfig(bh, bw, bn, 4 if bh * bw >= 32 else 2)
