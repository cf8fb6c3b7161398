"""Depthwise conv2d forward family: a direct Triton mainloop, its config space and its heuristic default.

Entry points: `conv2d_depthwise_mainloop` (@triton.jit, called by the generated kernels, see codegen.py),
`FAMILY`, `is_depthwise(x_shape, w_shape)`, `pixel_alignment(x)`, `DepthwiseConfig` (the typed tuning space),
`fast_configs(default)` and `default_config(problem)`.

Depthwise means groups = C: the weight is [K, 1, R, S] with K a multiple of C, and output channel k reads
input channel k // (K / C) alone (MobileNet's, EfficientNet's and ConvNeXt's 3x3 to 7x7 convs). There is no
reduction across channels, so no GEMM and no tensor cores: rows are output pixels (n, oh, ow), columns are
output channels, and for each tap (r, s) the program loads one shifted [BM pixels, BN channels] input tile,
contiguous along the channels in channels_last, and multiplies it by the tap's [BN] weights in fp32. A tile's
pixels are a box of one image, so the taps of one program reread a small patch of input (the box and its
halo), which L1 serves.
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
def conv2d_depthwise_mainloop(x, w, NB, H, W, C, KO, OH, OW, R, MULT,
                              s_xn, s_xc, s_xh, s_xw, s_wk, s_wr, s_ws, s_on, s_oh, s_ow,
                              stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                              BM: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
                              S: tl.constexpr, VEC: tl.constexpr, SPLIT_K: tl.constexpr):
    """One program's fp32 [BM, BN] outputs, plus the indices the epilogue needs. The kernel's R rows of taps
    loop; the S taps of a row unroll (S is constexpr), so a row's loads are in flight together. The input's
    pixel strides come divided by VEC, their common alignment in elements: Triton knows only 16-divisible
    arguments, and MobileNet's 72 or 120 channels would otherwise read 2 bytes at a time."""
    pid = tl.program_id(0)
    tiles_w = cdiv(OW, BW)
    tiles_hw = cdiv(OH, BH) * tiles_w
    tiles_m = NB * tiles_hw
    # a tile is a BH x BW box of one image's output pixels (its inputs, halo included, stay in L1 for all taps);
    # neighbouring programs take neighbouring boxes of one channel block, so they share halo rows in L2
    tile_m = pid % tiles_m
    i = tl.arange(0, BM)
    n_i = tl.full((BM,), tile_m // tiles_hw, dtype=tl.int32)
    oh = (tile_m % tiles_hw) // tiles_w * BH + i // BW
    ow = (tile_m % tiles_w) * BW + i % BW
    offs_k = (pid // tiles_m) * BN + tl.arange(0, BN)
    row_ok = (oh < OH) & (ow < OW)
    k_ok = offs_k < KO
    p_i = oh * OW + ow
    ih0 = oh * stride_h - pad_h
    iw0 = ow * stride_w - pad_w
    x_rows = x + n_i * (s_xn * VEC)
    x_cols = (offs_k // MULT) * s_xc
    w_cols = w + offs_k * s_wk
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for r in range(R):
        ih = ih0 + r * dil_h
        h_ok = row_ok & (ih >= 0) & (ih < H)
        x_r = x_rows + ih * (s_xh * VEC)
        w_r = w_cols + r * s_wr
        for s in tl.static_range(S):
            iw = iw0 + s * dil_w
            ok = h_ok & (iw >= 0) & (iw < W)
            x_t = tl.load((x_r + iw * (s_xw * VEC))[:, None] + x_cols[None, :], mask=ok[:, None] & k_ok[None, :],
                          other=0.0)
            w_t = tl.load(w_r + s * s_ws, mask=k_ok, other=0.0)
            acc += x_t.to(tl.float32) * w_t.to(tl.float32)[None, :]
    out_rows = n_i * s_on + oh * s_oh + ow * s_ow
    return acc, pid, 0, n_i, p_i, row_ok, out_rows, offs_k, tile_m


FAMILY = Family(
    name="conv2d_depthwise", module=__name__, mainloop="conv2d_depthwise_mainloop",
    args=("x", "w", "NB", "H", "W", "C", "KO", "OH", "OW", "R", "MULT",
          "s_xn", "s_xc", "s_xh", "s_xw", "s_wk", "s_wr", "s_ws", "s_on", "s_oh", "s_ow",
          "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w"),
    constexprs=("BM", "BN", "BH", "BW", "S", "VEC", "SPLIT_K"),
    n_cols="KO", s_out_c="s_ok",
)


@dataclasses.dataclass(frozen=True)
class DepthwiseConfig:
    """One point of the tuning space; `check` says whether it is legal for a problem."""
    block_h: int = 8  # the tile's box of output pixels, block_h x block_w
    block_w: int = 8
    block_n: int = 32  # channels
    num_warps: int = 4

    @property
    def block_m(self) -> int:
        return self.block_h * self.block_w

    def check(self, p: ConvProblem) -> bool:
        # the fp32 accumulator and a row of taps' input tiles in flight stay in registers
        return (self.block_m * self.block_n <= 64 * 32 * self.num_warps and self.block_n <= max(16, 2 * p.k)
                and self.block_h <= max(1, 2 * p.oh) and self.block_w <= max(1, 2 * p.ow))


SPACE = {  # the tuner (tuning/space.py) enumerates this product and keeps the configs that pass check()
    "block_h": (1, 2, 4, 8, 16), "block_w": (4, 8, 16, 32, 64), "block_n": (16, 32, 64, 128),
    "num_warps": (2, 4, 8),
}


def fast_configs(default: DepthwiseConfig) -> list[DepthwiseConfig]:
    """The "fast" level: the default and the tiles that won somewhere among the zoo's depthwise shapes at
    batch 1 and 256 (H100, bench/depthwise.py, out of ten)."""
    tiles = ((8, 8, 32, 4), (4, 8, 32, 2), (4, 16, 32, 4), (4, 8, 64, 4), (1, 64, 32, 4))
    return [default, *(DepthwiseConfig(*t) for t in tiles)]


def default_config(p: ConvProblem) -> DepthwiseConfig:
    """An 8 x 8 box (or the image, when smaller) of 64 bytes of channels a pixel."""
    bh = min(8, triton.next_power_of_2(p.oh))
    bw = min(8, triton.next_power_of_2(p.ow))
    return DepthwiseConfig(bh, bw, 16 if p.k <= 16 else 32, 4 if bh * bw >= 32 else 2)
