"""Conv2d forward family: implicit-GEMM Triton mainloop, its config space and its heuristic default.

Entry points: `conv2d_fprop_mainloop` and `conv2d_tma_mainloop` (@triton.jit, called by the generated kernels,
see codegen.py), `FAMILY` and `TMA_FAMILY`, `tma_box`, `ConvConfig` (the typed tuning space),
`default_config(problem)`, `few_rows_config(problem, tma)` (the tuner's small tile) and `tiles(config, problem)`.

The GEMM view: rows are output pixels (n, oh, ow), columns are output channels k, the reduction runs over
(r, s, c) with c innermost. So an input tile is BM pixels x BK channels, contiguous in channels_last, and a
weight tile is BK channels x BN filters read in K-R-S-C order, which is the physical order of channels_last
weights: no copy or repack is made for any layout, only the strides differ. groups=1 only.
When C is tiny (the RGB stem) a channel block would be mostly padding, so FLAT runs one reduction index over
all of (r, s, c) instead, gathering the input per element.
"""
from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from .codegen import Family
from .matmul import persistent_ok, split_k_heuristic, swap_ok, tiles_fit
from .tiles import cdiv, k_range, mma, prefetch_rows, swizzle_tile, tile_offsets


@triton.jit
def conv2d_fprop_mainloop(x, w, NB, H, W, C, KO, OH, OW, R, S,
                          s_xn, s_xc, s_xh, s_xw, s_wk, s_wc, s_wr, s_ws, s_on, s_oh, s_ow,
                          stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          SPLIT_K: tl.constexpr, FLAT: tl.constexpr, PRECISION: tl.constexpr):
    """One program's fp32 partial over its split of (r, s, c), plus the indices the epilogue needs."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(2)
    M = NB * OH * OW
    offs_m, offs_n, rows, cols, tile_m = tile_offsets(pid, M, KO, BM, BN, GROUP_M)
    n_i = rows // (OH * OW)
    p_i = rows % (OH * OW)
    oh = p_i // OW
    ow = p_i % OW
    ih0 = oh * stride_h - pad_h
    iw0 = ow * stride_w - pad_w
    x_rows = x + n_i * s_xn
    w_cols = w + cols * s_wk
    offs_k = tl.arange(0, BK)
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    if FLAT:
        red = R * S * C
        lo, hi = k_range(pid_k, cdiv(red, BK), SPLIT_K)
        for kb in range(lo, hi):
            kk = kb * BK + offs_k
            k_ok = kk < red
            c = kk % C
            r = kk // C // S
            s = kk // C % S
            ih = ih0[:, None] + (r * dil_h)[None, :]
            iw = iw0[:, None] + (s * dil_w)[None, :]
            ok = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W) & k_ok[None, :]
            x_t = tl.load(x_rows[:, None] + ih * s_xh + iw * s_xw + c[None, :] * s_xc, mask=ok, other=0.0)
            w_t = tl.load(w_cols[None, :] + (r * s_wr + s * s_ws + c * s_wc)[:, None], mask=k_ok[:, None], other=0.0)
            acc = mma(x_t, w_t, acc, PRECISION)
    else:
        c_blocks = cdiv(C, BK)
        lo, hi = k_range(pid_k, R * S * c_blocks, SPLIT_K)
        for t in range(lo, hi):
            rs = t // c_blocks
            cc = (t - rs * c_blocks) * BK + offs_k
            c_ok = cc < C
            r = rs // S
            s = rs % S
            ih = ih0 + r * dil_h
            iw = iw0 + s * dil_w
            ok = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            x_t = tl.load((x_rows + ih * s_xh + iw * s_xw)[:, None] + cc[None, :] * s_xc,
                          mask=ok[:, None] & c_ok[None, :], other=0.0)
            w_t = tl.load(w_cols[None, :] + (r * s_wr + s * s_ws) + cc[:, None] * s_wc, mask=c_ok[:, None], other=0.0)
            acc = mma(x_t, w_t, acc, PRECISION)
    out_rows = n_i * s_on + oh * s_oh + ow * s_ow
    return acc, pid, pid_k, n_i, p_i, offs_m < M, out_rows, offs_n, tile_m


@triton.jit
def conv2d_prefetch(w, NB, C, KO, OH, OW, R, S, s_wk, s_wc, s_wr, s_ws, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, FLAT: tl.constexpr):
    """FAMILY's Family.prefetch: the weight rows (output channels) of this program's tile. A KRSC weight's split
    asks for its own stretch of each row (krsc_range), any other layout for each row's whole span. Only the first
    row of tiles asks (the others read the same rows)."""
    tile_m, tile_n = swizzle_tile(tl.program_id(0), cdiv(NB * OH * OW, BM), cdiv(KO, BN), GROUP_M)
    span = (R - 1) * s_wr + (S - 1) * s_ws + (C - 1) * s_wc + 1
    k0 = span * 0
    k1 = span
    if SPLIT_K > 1:
        if FLAT:  # one reduction index over (r, s, c): the KRSC row itself, in blocks of BK
            lo, hi = k_range(tl.program_id(2), cdiv(span, BK), SPLIT_K)
            part0, part1 = lo * BK, tl.minimum(hi * BK, span)
        else:
            part0, part1 = krsc_range(tl.program_id(2), C, R, S, BK, SPLIT_K)
        krsc = (s_wc == 1) & (s_ws == C) & (s_wr == S * C)
        k0 = tl.where(krsc, part0, k0)
        k1 = tl.where(krsc, part1, k1)
    if tile_m == 0:
        prefetch_rows(w, tile_n * BN, KO, s_wk, k0, k1, BN)


@triton.jit
def krsc_range(pid_k, C, R, S, BK: tl.constexpr, SPLIT_K: tl.constexpr):
    """The elements [k0, k1) of a KRSC weight row that split pid_k reads, its reduction blocks being (r, s, BK
    channels) with the channels innermost, as both conv mainloops walk them."""
    c_blocks = cdiv(C, BK)
    lo, hi = k_range(pid_k, R * S * c_blocks, SPLIT_K)
    lo = tl.minimum(lo, hi)  # a trailing split past the last block: empty, [k1, k1)
    k0 = lo // c_blocks * C + tl.minimum(lo % c_blocks * BK, C)
    k1 = hi // c_blocks * C + tl.minimum(hi % c_blocks * BK, C)
    return k0, k1


@triton.jit
def conv2d_tma_prefetch(w_mat, NB, C, KO, OH, OW, R, S, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr):
    """TMA_FAMILY's Family.prefetch: this program's stretch (krsc_range) of its tile's rows of the dense KRSC
    weight w_mat, asked by the first row of tiles only."""
    IMGS: tl.constexpr = BM // (BH * BW)
    tile_m, tile_n = swizzle_tile(tl.program_id(0), cdiv(NB, IMGS) * cdiv(OH, BH) * cdiv(OW, BW), cdiv(KO, BN),
                                  GROUP_M)
    if tile_m == 0:
        k0, k1 = krsc_range(tl.program_id(2), C, R, S, BK, SPLIT_K)
        prefetch_rows(w_mat, tile_n * BN, KO, R * S * C, k0, k1, BN)


@triton.jit
def conv2d_tma_mainloop(x_desc, w_desc, w_mat, NB, H, W, C, KO, OH, OW, R, S, s_on, s_oh, s_ow, pad_h, pad_w, dil_h,
                        dil_w,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                        SPLIT_K: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, PRECISION: tl.constexpr,
                        WS: tl.constexpr):
    """conv2d_fprop_mainloop for a stride-1 conv whose channels_last input and weight TMA descriptors read.

    A tile is a box of output pixels, BM // (BH * BW) images x BH rows x BW columns, so that for each tap
    (r, s) its inputs are one shifted [images, BH, BW, BK] box of the NHWC input: one bulk copy, no address
    math, and the box's parts past an edge (the padding, negative coordinates included) read as zeros. The
    weight tile is a [BN, 1, 1, BK] box of the KRSC weight. Pixels of the box past the output's edge are
    computed and masked at the store. w_mat, the weight w_desc reads, is conv2d_tma_prefetch's."""
    IMGS: tl.constexpr = BM // (BH * BW)
    pid = tl.program_id(0)
    pid_k = tl.program_id(2)
    tiles_w = cdiv(OW, BW)
    tiles_h = cdiv(OH, BH)
    tile_m, tile_n = swizzle_tile(pid, cdiv(NB, IMGS) * tiles_h * tiles_w, cdiv(KO, BN), GROUP_M)
    n0 = tile_m // (tiles_h * tiles_w) * IMGS
    oh0 = tile_m // tiles_w % tiles_h * BH
    ow0 = tile_m % tiles_w * BW
    c_blocks = cdiv(C, BK)
    lo, hi = k_range(pid_k, R * S * c_blocks, SPLIT_K)
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for t in tl.range(lo, hi, warp_specialize=WS):
        rs = t // c_blocks
        c0 = (t - rs * c_blocks) * BK
        r = rs // S
        s = rs % S
        x_t = x_desc.load([n0, oh0 - pad_h + r * dil_h, ow0 - pad_w + s * dil_w, c0]).reshape(BM, BK)
        w_t = w_desc.load([tile_n * BN, r, s, c0]).reshape(BN, BK)
        acc = mma(x_t, tl.trans(w_t), acc, PRECISION)
    i = tl.arange(0, BM)
    n_i = n0 + i // (BH * BW)
    oh = oh0 + i // BW % BH
    ow = ow0 + i % BW
    row_ok = (n_i < NB) & (oh < OH) & (ow < OW)
    offs_n = tile_n * BN + tl.arange(0, BN)
    return acc, pid, pid_k, n_i, oh * OW + ow, row_ok, n_i * s_on + oh * s_oh + ow * s_ow, offs_n, tile_m


TMA_FAMILY = Family(
    name="conv2d_tma", module=__name__, mainloop="conv2d_tma_mainloop",
    args=("x_desc", "w_desc", "w_mat", "NB", "H", "W", "C", "KO", "OH", "OW", "R", "S", "s_on", "s_oh", "s_ow",
          "pad_h", "pad_w", "dil_h", "dil_w"),
    constexprs=("BM", "BN", "BK", "GROUP_M", "SPLIT_K", "BH", "BW", "PRECISION", "WS"),
    n_cols="KO", s_out_c="s_ok",
    prefetch="conv2d_tma_prefetch(w_mat, NB, C, KO, OH, OW, R, S, BM, BN, BK, GROUP_M, SPLIT_K, BH, BW)",
)


def tma_box(block_m: int, n: int, oh: int, ow: int, r: int = 3, s: int = 3) -> tuple[int, int]:
    """(BH, BW) of the TMA mainloop's pixel box for BM = block_m (the rest of BM is whole images): powers of two
    (Triton's tiles are) that read the fewest input pixels per output pixel: the computed pixels past the
    output's edges, times the halo an r x s window adds around each image's box."""
    def cost(bh, bw):
        imgs = block_m // (bh * bw)
        padded = (triton.cdiv(n, imgs) * imgs) * (triton.cdiv(oh, bh) * bh) * (triton.cdiv(ow, bw) * bw)
        return padded * (bh + r - 1) * (bw + s - 1) / (bh * bw)
    boxes = [(1 << i, 1 << j) for i in range(9) for j in range(9) if (1 << (i + j)) <= block_m]
    return min(boxes, key=lambda b: (cost(*b), -b[1]))


FAMILY = Family(
    name="conv2d_fprop", module=__name__, mainloop="conv2d_fprop_mainloop",
    args=("x", "w", "NB", "H", "W", "C", "KO", "OH", "OW", "R", "S",
          "s_xn", "s_xc", "s_xh", "s_xw", "s_wk", "s_wc", "s_wr", "s_ws", "s_on", "s_oh", "s_ow",
          "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w"),
    constexprs=("BM", "BN", "BK", "GROUP_M", "SPLIT_K", "FLAT", "PRECISION"),
    n_cols="KO", s_out_c="s_ok",
    prefetch="conv2d_prefetch(w, NB, C, KO, OH, OW, R, S, s_wk, s_wc, s_wr, s_ws, BM, BN, BK, GROUP_M, SPLIT_K, FLAT)",
)


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    n: int
    c: int
    k: int
    r: int
    s: int
    oh: int
    ow: int
    dtype_bytes: int
    sms: int  # streaming multiprocessors on the device (1 under the interpreter)
    unit_w: bool = True  # stride and dilation 1 along the width (the depthwise strip mainloop needs it)

    @property
    def m(self) -> int:
        return self.n * self.oh * self.ow


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """One point of the tuning space; `check` says whether it is legal for a problem."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    split_k: int = 1
    flat: bool = False
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False  # TMA descriptors: a 1x1 conv as a GEMM (matmul.gemm_tma_mainloop) where launch.conv_as_gemm
    #                    accepts it, else conv2d_tma_mainloop where launch.conv_tma_operands does; else ignored

    ws: bool = False  # warp-specialise a TMA mainloop's loop (ignored without tma)
    persistent: int = 0  # > 0: a 1x1 conv as a persistent GEMM (matmul.PERSISTENT_FAMILY), this many programs an SM;
    #                      ignored where the conv is no plain GEMM
    tma_store: bool = False  # a 1x1 conv as a GEMM: its output written by bulk stores (matmul.GemmConfig.tma_store);
    #                          like persistent, not for a conv with more than one tap
    image: bool = False  # kernels/conv2d_image.py instead (a conv over an image of at most 4 channels: the image
    #                      padded once, then overlapping views of its rows); the other fields are then ignored
    swap: bool = False  # a 1x1 conv of one image as the GEMM of its transposed output (matmul.GemmConfig.swap):
    #                     block_m tiles the output channels, block_n the pixels

    def check(self, p: ConvProblem) -> bool:
        return (tiles_fit(self, p.dtype_bytes) and not (self.tma and (self.flat or self.block_k * p.dtype_bytes < 16))
                and not (self.ws and not self.tma) and persistent_ok(self)
                and not ((self.persistent or self.tma_store) and p.r * p.s > 1)
                and not (self.image and (p.c > 4 or p.s > 8 or p.k > 256))
                and swap_ok(self, p.n) and not (self.swap and (p.r * p.s > 1 or self.flat or self.image)))


SPACE = {  # the tuner (tuning/space.py) enumerates this product and keeps the configs that pass check()
    "block_m": (32, 64, 128, 256), "block_n": (32, 64, 128, 256), "block_k": (16, 32, 64),
    "group_m": (8,), "split_k": (1, 2, 4, 8), "flat": (False, True), "num_warps": (4, 8), "num_stages": (2, 3, 4),
    "tma": (False, True), "ws": (False, True), "persistent": (0, 1, 2), "tma_store": (False, True),
    "swap": (False, True),
}


def tiles(cfg: ConvConfig, p: ConvProblem) -> int:
    """Output tiles of cfg's grid (before any split)."""
    return triton.cdiv(p.m, cfg.block_m) * triton.cdiv(p.k, cfg.block_n)


def few_rows_config(p: ConvProblem, tma: bool) -> ConvConfig:
    """32 x 64 tiles, split for their own count of tiles (the heuristic's rule), for a conv whose default tiles
    under-fill the GPU: at batch 1, layer 4's 3x3 conv took 7.4 us so (split 8) and layer 3's 6.7 (split 4),
    against cuDNN's 11.4 and 7.7 and 8.8-10.8 for the other tiles (H100, bench/small_m.py, BENCHMARKS.md
    thirty-fourth session). tma: the conv is a GEMM that the TMA mainloop reads (a 1x1 conv)."""
    bk, flat = _reduction_block(p)
    return _split(ConvConfig(32, 64, bk, 8, 1, flat, 4, 3, tma=tma and not flat), p)


def _reduction_block(p: ConvProblem) -> tuple[int, bool]:
    """(block_k, flat): FLAT for a few channels (the RGB stem), one reduction index over (r, s, c)."""
    flat = p.c < 16
    return 16 if (p.c <= 16 and not flat) else 32 if (p.c <= 32 or p.dtype_bytes == 4 or flat) else 64, flat


def _split(cfg: ConvConfig, p: ConvProblem) -> ConvConfig:
    """cfg split by the heuristic's rule (matmul.split_k_heuristic) for its own count of tiles."""
    red_blocks = (triton.cdiv(p.r * p.s * p.c, cfg.block_k) if cfg.flat
                  else p.r * p.s * triton.cdiv(p.c, cfg.block_k))
    return dataclasses.replace(cfg, split_k=split_k_heuristic(tiles(cfg, p), red_blocks, p.sms))


def default_config(p: ConvProblem) -> ConvConfig:
    small = p.m * p.k <= 64 * 64
    bm = 32 if p.m <= 32 else 64 if (p.m <= 64 or small) else 128
    bn = 32 if p.k <= 32 else 64 if (p.k <= 64 or small) else 128
    bk, flat = _reduction_block(p)
    warps = 8 if bm * bn >= 128 * 128 else 4
    stages = 3 if bm * bn >= 128 * 128 else 4
    return _split(ConvConfig(bm, bn, bk, 8, 1, flat, warps, stages), p)
