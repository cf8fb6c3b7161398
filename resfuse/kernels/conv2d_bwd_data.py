"""Conv2d data-gradient (dgrad) family: implicit-GEMM Triton mainloop, its config space and its heuristic default.

(Named conv2d_bwd_data.py, not conv2d_dgrad.py: a submodule `kernels.conv2d_dgrad` would replace the entry-point
function of that name, as matmul.py explains for gemm.)

Entry points: `conv2d_dgrad_mainloop` (@triton.jit, called by the generated kernels, see codegen.py),
`FAMILY`, `DgradConfig` (the typed tuning space), `default_config(problem)` and `tap_inverse`.

This is the backward pass's FuseAddToOutput producer: grad_input = dgrad(grad_out, W), then the skip gradient
and relu's gradient run in the epilogue, e.g. threshold_bwd[#0.0](add(acc,full0),full1).

The GEMM view: rows are grad_input pixels (n, h, w), columns are input channels c, the reduction runs over
the taps (r, s) and the forward conv's output channels k, k innermost. Pixel h takes tap r from grad_out row
oh = (h + pad - r*dil) / stride when that is a whole number in [0, OH). A grad_out tile is BM pixels x BK
channels (contiguous in channels_last), a weight tile BK filters x BN channels at one tap (contiguous in a
channels_last weight, whose physical order is K-R-S-C); as in fprop, no copy or repack is made for any layout.

Strided convs: whether tap r reaches pixel h depends only on h mod stride (its phase). So the rows are
grouped by phase (grid axis 1), each program's rows share one, and a program loops over exactly the taps that
reach its phase: no masked-out MMAs, where a plain masked loop would waste 3/4 of a stride-2 3x3's work. A
phase's rows are (n, hq, wq) with h = hq*stride + phase; rows whose h or w is past the edge (when stride does
not divide H or W) are computed but not stored. The taps that reach phase ph are r0, r0 + step, ... where
step = stride/g, g = gcd(stride, dil), and r0 solves r0*dil = ph + pad (mod stride), i.e.
r0 = ((ph + pad)/g * inv) mod step with inv the inverse of dil/g mod step (tap_inverse, on the host);
none when g does not divide ph + pad. The j-th such tap reads grad_out row hq + d0 - j*dil/g. Stride 1 is
the single phase 0 with every tap, oh = h + pad - r*dil: the plain correlation with the flipped filter.
groups=1 only.

A 1x1, stride-1, unpadded dgrad on a channels_last grad_out is the plain GEMM grad_out [N*H*W, K] @ W [K, C]:
with `tma` in its config it runs the GEMM family's TMA or persistent mainloop instead (launch.dgrad_as_gemm),
as the forward 1x1 conv does.
"""
from __future__ import annotations

import dataclasses
import math

import triton
import triton.language as tl

from .codegen import Family
from .matmul import GemmConfig, split_k_heuristic
from .tiles import cdiv, k_range, mma, tile_offsets


@triton.jit
def phase_taps(ph, pad, dil, stride, g, inv, R):
    """For input phase ph along one dim: (first tap, tap step, tap count, grad_out offset of the first tap,
    offset step); the j-th tap is first + j*step and reads grad_out row q + d0 - j*dd for row q of the phase."""
    step = stride // g
    a = ph + pad
    r0 = (a // g * inv) % step
    n = tl.where(a % g == 0, (R - r0 + step - 1) // step, 0)
    dd = dil // g
    d0 = (a + (step - r0) * dil) // stride - dd  # (a - r0*dil) / stride, exact, kept off negative division
    return r0, step, n, d0, dd


@triton.jit
def conv2d_dgrad_mainloop(g, w, NB, H, W, C, KO, OH, OW, R, S,
                          s_gn, s_gk, s_gh, s_gw, s_wk, s_wc, s_wr, s_ws, s_on, s_oh, s_ow,
                          stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, gcd_h, gcd_w, inv_h, inv_w,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          SPLIT_K: tl.constexpr, PRECISION: tl.constexpr):
    """One program's fp32 partial over its split of (its phase's taps, k), plus the indices the epilogue needs."""
    pid = tl.program_id(0)
    phase = tl.program_id(1)
    pid_k = tl.program_id(2)
    ph = phase // stride_w
    pw = phase % stride_w
    HQ = cdiv(H, stride_h)
    WQ = cdiv(W, stride_w)
    MQ = NB * HQ * WQ
    offs_m, offs_n, rows, cols, tile_m = tile_offsets(pid, MQ, C, BM, BN, GROUP_M)
    n_i = rows // (HQ * WQ)
    q = rows % (HQ * WQ)
    hq = q // WQ
    wq = q % WQ
    r0, step_r, nr, dh0, dr = phase_taps(ph, pad_h, dil_h, stride_h, gcd_h, inv_h, R)
    s0, step_s, ns, dw0, ds = phase_taps(pw, pad_w, dil_w, stride_w, gcd_w, inv_w, S)
    g_rows = g + n_i * s_gn
    w_cols = w + cols * s_wc
    offs_k = tl.arange(0, BK)
    k_blocks = cdiv(KO, BK)
    lo, hi = k_range(pid_k, nr * ns * k_blocks, SPLIT_K)
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for t in range(lo, hi):
        tap = t // k_blocks
        kk = (t - tap * k_blocks) * BK + offs_k
        k_ok = kk < KO
        j = tap // ns
        i = tap - j * ns
        oh = hq + (dh0 - j * dr)
        ow = wq + (dw0 - i * ds)
        ok = (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW)
        g_t = tl.load((g_rows + oh * s_gh + ow * s_gw)[:, None] + kk[None, :] * s_gk,
                      mask=ok[:, None] & k_ok[None, :], other=0.0)
        w_t = tl.load(w_cols[None, :] + ((r0 + j * step_r) * s_wr + (s0 + i * step_s) * s_ws) + kk[:, None] * s_wk,
                      mask=k_ok[:, None], other=0.0)
        acc = mma(g_t, w_t, acc, PRECISION)
    h = hq * stride_h + ph
    wi = wq * stride_w + pw
    row_ok = (offs_m < MQ) & (h < H) & (wi < W)
    out_rows = n_i * s_on + h * s_oh + wi * s_ow
    tile = phase * (cdiv(MQ, BM) * cdiv(C, BN)) + pid
    return acc, tile, pid_k, n_i, h * W + wi, row_ok, out_rows, offs_n, phase * cdiv(MQ, BM) + tile_m


FAMILY = Family(
    name="conv2d_dgrad", module=__name__, mainloop="conv2d_dgrad_mainloop",
    args=("g", "w", "NB", "H", "W", "C", "KO", "OH", "OW", "R", "S",
          "s_gn", "s_gk", "s_gh", "s_gw", "s_wk", "s_wc", "s_wr", "s_ws", "s_on", "s_oh", "s_ow",
          "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w", "gcd_h", "gcd_w", "inv_h", "inv_w"),
    constexprs=("BM", "BN", "BK", "GROUP_M", "SPLIT_K", "PRECISION"),
    n_cols="C", s_out_c="s_oc",
)


def tap_inverse(stride: int, dil: int) -> tuple[int, int]:
    """(g, inv) for phase_taps: g = gcd(stride, dil) and inv = (dil/g)^-1 mod stride/g (0 when that is 1)."""
    g = math.gcd(stride, dil)
    step = stride // g
    return g, (pow(dil // g, -1, step) if step > 1 else 0)


@dataclasses.dataclass(frozen=True)
class DgradProblem:
    n: int
    c: int  # grad_input channels: the GEMM's columns
    k: int  # grad_out channels: the reduction
    r: int
    s: int
    h: int  # grad_input height and width
    w: int
    stride_h: int
    stride_w: int
    dtype_bytes: int
    sms: int  # streaming multiprocessors on the device (1 under the interpreter)

    @property
    def batch(self) -> int:  # GemmConfig.check's batch of matrices: a dgrad is one (its 1x1 case a plain GEMM)
        return 1

    @property
    def phases(self) -> int:
        return self.stride_h * self.stride_w

    @property
    def m_per_phase(self) -> int:
        return self.n * triton.cdiv(self.h, self.stride_h) * triton.cdiv(self.w, self.stride_w)

    @property
    def taps_per_phase(self) -> int:  # at most; fewer when dilation shares a factor with the stride
        return triton.cdiv(self.r, self.stride_h) * triton.cdiv(self.s, self.stride_w)


# The same tile knobs as the GEMM's (block_m/n/k, group_m, split_k, warps, stages) and the same fit check.
DgradConfig = GemmConfig


SPACE = {  # every point of this product that passes check() is a legal config
    "block_m": (32, 64, 128, 256), "block_n": (32, 64, 128, 256), "block_k": (16, 32, 64),
    "group_m": (8,), "split_k": (1, 2, 4, 8), "num_warps": (4, 8), "num_stages": (2, 3, 4),
}


def default_config(p: DgradProblem) -> DgradConfig:
    m = p.m_per_phase
    small = m * p.c <= 64 * 64
    bm = 32 if m <= 32 else 64 if (m <= 64 or small) else 128
    bn = 32 if p.c <= 32 else 64 if (p.c <= 64 or small) else 128
    bk = 16 if p.k <= 16 else 32 if (p.k <= 32 or p.dtype_bytes == 4) else 64
    warps = 8 if bm * bn >= 128 * 128 else 4
    stages = 3 if bm * bn >= 128 * 128 else 4
    tiles = p.phases * triton.cdiv(m, bm) * triton.cdiv(p.c, bn)
    split = split_k_heuristic(tiles, p.taps_per_phase * triton.cdiv(p.k, bk), p.sms)
    return DgradConfig(bm, bn, bk, 8, split, warps, stages)
