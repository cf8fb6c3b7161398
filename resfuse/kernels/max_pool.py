"""2-D max pooling, forward (with the argmax indices training saves) and backward, as ATen computes them.

Entry points, reached through resfuse.kernels (ops/pooling.py calls them for the ops passes/pooling.py puts
in graphs):
  max_pool2d(x, kernel, stride, padding, dilation, out, indices=None) -> (out, indices)
  max_pool2d_backward(grad_out, indices, kernel, stride, padding, dilation, grad_input, mask=None,
                      threshold=0.0, mask_is_input=False) -> grad_input

ATen's CUDA kernels for a channels_last max-pool run far below the memory bandwidth: in a ResNet-50 bs256
training step the stem's pool took 0.82 ms forward and 1.83 ms backward (BENCHMARKS.md), for about 0.9 GB and
0.9 GB of traffic. Both kernels here tile [rows, channels] over any strides (channels_last reads whole rows of
channels), so they run at the bandwidth of whichever layout they get.

Semantics are ATen's: a NaN in a window wins (the last NaN scanned, rows then columns); otherwise the first
maximum wins; padding never does. `indices` holds ih * W + iw of the winner in its input plane; a window of
only -inf points at its first in-bounds element (ATen's CPU and NCHW CUDA kernels; its NHWC CUDA kernel says
0). Indices of a narrow dtype (int8, int16) are window codes instead, which only our backward reads
(passes/pooling.py asks for int8 where the indices are saved for the backward alone): the winner's tap in its
window, kh * KW + kw, plus NOT_POSITIVE where the maximum is <= 0 (not NaN). An eighth of the bytes, and the flag
is relu's gradient at the winner, which is all the stem's relu -> max-pool backward needs of the relu's output
(the winner's value is the pooled value): the backward reads neither int64 indices nor a mask as large as the
pool's input. On the ResNet-50 bs256 stem (H100) that took the forward from 330 to 259 us and the backward from
665 to 369 us (bench/pool_kernels.py, BENCHMARKS.md). The backward
gathers instead of scattering: each input element sums the gradients of the (at most
ceil(KH / stride) * ceil(KW / stride)) windows that chose it, in ATen's order (rows, then columns, ascending),
so there are no atomics, no zero fill and the result is deterministic. An optional `mask` applies relu's
gradient on the way out (threshold_backward(grad_input, mask, threshold)): the stem's relu -> max-pool.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import WINDOW_NOT_POSITIVE
from .plan import launch, pdl_meta
from .tiles import dependent_launch

NOT_POSITIVE = tl.constexpr(WINDOW_NOT_POSITIVE)


@triton.jit
def _rows(offs, A, B, BIG: tl.constexpr):
    """Split flat row numbers into (n, a, b) for an [N, A, B] grid of pixels. Index math is int32 (int64
    division is emulated and made the kernels compute-bound); with BIG the sample index, which multiplies the
    largest stride, is int64 so that offsets past 2**31 elements do not wrap."""
    b = offs % B
    t = offs // B
    n = t // A
    if BIG:
        n = n.to(tl.int64)
    return n, t % A, b


@triton.jit
def _output_tile(N, C, OH, OW, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                 BIG: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr):
    """This program's [BM output pixels, BC channels] tile: (n, oh, ow, channels, which rows and which channels
    exist, each window's first input row and column)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    n, oh, ow = _rows(rows, OH, OW, BIG)
    return n, oh, ow, offs_c, rows < N * OH * OW, offs_c < C, oh * SH - PH, ow * SW - PW


@triton.jit
def max_pool2d_kernel(x, out, idx, N, C, H, W, OH, OW, s_xn, s_xc, s_xh, s_xw, s_on, s_oc, s_oh, s_ow,
                      s_in, s_ic, s_ih, s_iw, KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr,
                      SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                      WITH_INDICES: tl.constexpr, WINDOW: tl.constexpr, BIG: tl.constexpr, BM: tl.constexpr,
                      BC: tl.constexpr, PDL: tl.constexpr):
    """One [BM output pixels, BC channels] tile: the max over each pixel's window, and where it was (WINDOW: as
    a window code, see the module's docstring)."""
    dependent_launch(PDL)
    n, oh, ow, offs_c, row_ok, ok_c, ih0, iw0 = _output_tile(N, C, OH, OW, SH, SW, PH, PW, BIG, BM, BC)
    # the first in-bounds tap of each window: where a window of only -inf points (a window with none, which
    # ATen's checks rule out, keeps a tap inside the window so that its code stays below 64)
    kh0 = (tl.maximum(-ih0, 0) + DH - 1) // DH
    kw0 = (tl.maximum(-iw0, 0) + DW - 1) // DW
    if WINDOW:
        first = tl.minimum(kh0, KH - 1) * KW + tl.minimum(kw0, KW - 1)
    else:
        first = (ih0 + kh0 * DH) * W + iw0 + kw0 * DW
    best = tl.full([BM, BC], float("-inf"), tl.float32)
    where = tl.broadcast_to(first[:, None], [BM, BC])
    x_c = (offs_c * s_xc)[None, :]
    for kh in tl.static_range(KH):
        ih = ih0 + kh * DH
        for kw in tl.static_range(KW):
            iw = iw0 + kw * DW
            inside = row_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            v = tl.load(x + (n * s_xn + ih * s_xh + iw * s_xw)[:, None] + x_c,
                        mask=inside[:, None] & ok_c[None, :], other=float("-inf")).to(tl.float32)
            take = (v > best) | (v != v)
            best = tl.where(take, v, best)
            where = tl.where(take, kh * KW + kw if WINDOW else (ih * W + iw)[:, None], where)
    ok = row_ok[:, None] & ok_c[None, :]
    tl.store(out + (n * s_on + oh * s_oh + ow * s_ow)[:, None] + (offs_c * s_oc)[None, :],
             best.to(out.dtype.element_ty), mask=ok)
    if WITH_INDICES:
        if WINDOW:
            where = tl.where(best <= 0.0, where + NOT_POSITIVE, where)
        tl.store(idx + (n * s_in + oh * s_ih + ow * s_iw)[:, None] + (offs_c * s_ic)[None, :],
                 where.to(idx.dtype.element_ty), mask=ok)


@triton.jit
def max_pool2d_backward_kernel(g, idx, dx, m, N, C, H, W, OH, OW, s_gn, s_gc, s_gh, s_gw, s_in, s_ic, s_ih, s_iw,
                               s_dn, s_dc, s_dh, s_dw, s_mn, s_mc, s_mh, s_mw, THRESHOLD,
                               KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                               PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                               MASK: tl.constexpr, WINDOW: tl.constexpr, SIGN: tl.constexpr, BIG: tl.constexpr,
                               BM: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    """One [BM input pixels, BC channels] tile of grad_input: the sum of the gradients of the windows whose
    index points here, in ascending (oh, ow) as ATen adds them. Without dilation the windows that cover ih are
    the ceil(KH / SH) ones up to (ih + PH) // SH: a 3x3 stride-2 pool visits 4, not one per tap (9). With
    dilation, window oh covers ih when ih = oh * SH - PH + kh * DH for a tap kh. The pooling's geometry is
    constexpr, so the divisions by the stride are shifts or multiplications. WINDOW: the indices are window
    codes, which point here when their tap is the one (ih, iw) is in that window; SIGN: relu's gradient comes
    from the codes' NOT_POSITIVE flag, not from the mask."""
    dependent_launch(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    row_ok = rows < N * H * W
    ok_c = offs_c < C
    n, ih, iw = _rows(rows, H, W, BIG)
    here = (ih * W + iw).to(tl.int64)[:, None]
    acc = tl.full([BM, BC], 0.0, tl.float32)  # not tl.zeros: a @jit helper (tiles.py)
    DENSE: tl.constexpr = DH == 1 and DW == 1
    NH: tl.constexpr = (KH + SH - 1) // SH if DENSE else KH
    NW: tl.constexpr = (KW + SW - 1) // SW if DENSE else KW
    for i in tl.static_range(NH):
        if DENSE:
            oh = (ih + PH) // SH - (NH - 1) + i
            ok_h = (oh >= 0) & (oh < OH) & (oh * SH - PH + KH > ih)
        else:
            oh_s = ih + PH - (KH - 1 - i) * DH  # taps descending: windows ascending
            oh = oh_s // SH
            ok_h = (oh_s >= 0) & (oh_s - oh * SH == 0) & (oh < OH)
        for j in tl.static_range(NW):
            if DENSE:
                ow = (iw + PW) // SW - (NW - 1) + j
                ok_w = (ow >= 0) & (ow < OW) & (ow * SW - PW + KW > iw)
            else:
                ow_s = iw + PW - (KW - 1 - j) * DW
                ow = ow_s // SW
                ok_w = (ow_s >= 0) & (ow_s - ow * SW == 0) & (ow < OW)
            ok = (row_ok & ok_h & ok_w)[:, None] & ok_c[None, :]
            chosen = tl.load(idx + (n * s_in + oh * s_ih + ow * s_iw)[:, None] + (offs_c * s_ic)[None, :],
                             mask=ok, other=-1)
            if WINDOW:
                chosen = chosen.to(tl.int32)
                if DENSE:
                    tap = ((ih + PH - oh * SH) * KW + iw + PW - ow * SW)[:, None]
                else:
                    tap = (KH - 1 - i) * KW + KW - 1 - j
                if SIGN:  # a flagged code equals no tap: relu's gradient is 0 there
                    hit = chosen == tap
                else:
                    hit = (chosen & (NOT_POSITIVE - 1)) == tap
            else:
                hit = chosen == here
            gv = tl.load(g + (n * s_gn + oh * s_gh + ow * s_gw)[:, None] + (offs_c * s_gc)[None, :],
                         mask=ok & hit, other=0.0)
            acc += gv.to(tl.float32)
    ok = row_ok[:, None] & ok_c[None, :]
    if MASK:
        mv = tl.load(m + (n * s_mn + ih * s_mh + iw * s_mw)[:, None] + (offs_c * s_mc)[None, :], mask=ok,
                     other=0.0).to(tl.float32)
        acc = tl.where(mv <= THRESHOLD, 0.0, acc)
    tl.store(dx + (n * s_dn + ih * s_dh + iw * s_dw)[:, None] + (offs_c * s_dc)[None, :],
             acc.to(dx.dtype.element_ty), mask=ok)


@triton.jit
def window_extremes(x, N, C, H, W, OH, OW, s_xn, s_xc, s_xh, s_xw, s_on, s_oh, s_ow,
                    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr,
                    PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, BIG: tl.constexpr, BM: tl.constexpr,
                    BC: tl.constexpr):
    """One [BM output pixels, BC channels] tile: the largest and the smallest value of each window (a NaN in
    the window: NaN both), with what an epilogue needs in scope (epilogue_source.triton_body) and the output offsets."""
    n, oh, ow, offs_c, row_ok, mask_c, ih0, iw0 = _output_tile(N, C, OH, OW, SH, SW, PH, PW, BIG, BM, BC)
    hi = tl.full([BM, BC], float("-inf"), tl.float32)
    lo = tl.full([BM, BC], float("inf"), tl.float32)
    x_c = (offs_c * s_xc)[None, :]
    for kh in tl.static_range(KH):
        ih = ih0 + kh * DH
        for kw in tl.static_range(KW):
            iw = iw0 + kw * DW
            inside = (row_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))[:, None] & mask_c[None, :]
            v = tl.load(x + (n * s_xn + ih * s_xh + iw * s_xw)[:, None] + x_c, mask=inside, other=float("-inf"))
            v = v.to(tl.float32)
            # one max and one min an element, a NaN sticking (ATen's rule), instead of compares and selects
            hi = tl.maximum(hi, v, propagate_nan=tl.PropagateNan.ALL)
            lo = tl.minimum(lo, tl.where(inside, v, float("inf")), propagate_nan=tl.PropagateNan.ALL)
    mask = row_ok[:, None] & mask_c[None, :]
    hi = tl.where(mask, hi, 0.0)  # no infinities in the lanes past the edges, where the epilogue runs unstored
    lo = tl.where(mask, lo, 0.0)
    return hi, lo, n, oh * OW + ow, offs_c, mask_c, mask, n * s_on + oh * s_oh + ow * s_ow


def epilogue_source(signature: str) -> str:
    """A max-pool kernel whose input is `epilogue(x)` (epilogue.monotone_refusal(tree) is None). A function that
    is monotone within a channel takes its largest value over a window at the window's largest or smallest x,
    so the kernel evaluates the epilogue on those two and keeps the larger: the pool's input is never written."""
    from .. import epilogue as epi
    from .activations import HELPERS
    from .epilogue_source import triton_body, triton_params

    tree = epi.parse(signature)
    geometry = ("KH", "KW", "SH", "SW", "PH", "PW", "DH", "DW", "BIG", "BM", "BC")
    params = ["x", "out", "N", "C", "H", "W", "OH", "OW", "s_xn", "s_xc", "s_xh", "s_xw", "s_on", "s_oc", "s_oh",
              "s_ow", *triton_params(tree), *[f"{g}: tl.constexpr" for g in (*geometry, "PDL")]]
    body = triton_body(tree, out="y", out_ty="out.dtype.element_ty")
    body = "\n".join("    " + line for line in body.splitlines())
    param_lines = "".join(f"    {p},\n" for p in params)
    return f'''"""Generated by resfuse.kernels.max_pool; do not edit.

Max-pool of a monotone epilogue: {signature}
"""
import triton
import triton.language as tl

from resfuse.kernels.activations import {", ".join(HELPERS)}
from resfuse.kernels.max_pool import window_extremes
from resfuse.kernels.tiles import dependent_launch


@triton.jit
def resfuse_max_pool2d_epilogue(
{param_lines}):
    dependent_launch(PDL)
    hi, lo, s_idx, p_idx, offs_c, mask_c, mask, out_rows = window_extremes(
        x, N, C, H, W, OH, OW, s_xn, s_xc, s_xh, s_xw, s_on, s_oh, s_ow, {", ".join(geometry)})
    acc = hi
{body}
    y_hi = y
    acc = lo
{body}
    y = tl.maximum(y_hi, y, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out + out_rows[:, None] + (offs_c * s_oc)[None, :], y.to(out.dtype.element_ty), mask=mask)
'''


def max_pool2d_epilogue(x: torch.Tensor, operands, signature: str, kernel, stride, padding, dilation,
                        out: torch.Tensor, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out = max_pool2d(epilogue(x)), where the epilogue (per channel, monotone) reads `operands`."""
    from .. import epilogue as epi
    from .codegen import load_source

    n, c, h, w = x.shape
    oh, ow = out.shape[2:]
    if out.numel():
        bm, bc, warps = tile or _tile(c, x.stride(1))
        run = load_source("max_pool2d_epilogue", signature, lambda: epilogue_source(signature))
        op_args = [a for v in epi.operand_views(epi.parse(signature), operands, out.shape, 1) for a in (v, *v.stride())]
        grid = (triton.cdiv(n * oh * ow, bm), triton.cdiv(c, bc))
        launch(run, grid, x, out, n, c, h, w, oh, ow, *x.stride(), *out.stride(), *op_args,
               **_geometry(kernel, stride, padding, dilation), BIG=_big(x, out), BM=bm, BC=bc, num_warps=warps,
               **pdl_meta(x.device))
    return out


def _tile(c: int, channel_stride: int) -> tuple[int, int, int]:
    """(BM, BC, warps): wide along the channels when they are contiguous (channels_last), else along the rows.
    Small tiles: on the ResNet-50 stem pool (bs256, H100) 16 x 64 with 4 warps was the best of 24 tiles in each
    direction (`bench/pool_kernels.py --sweep`), 2.4x faster than 128 x 32 with 2 warps going backward."""
    if channel_stride == 1:
        bc = min(64, triton.next_power_of_2(c))
        return max(16, 1024 // bc), bc, 4
    return 64, min(16, triton.next_power_of_2(c)), 4


def _geometry(kernel, stride, padding, dilation) -> dict:
    return dict(KH=kernel[0], KW=kernel[1], SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1],
                DH=dilation[0], DW=dilation[1])


def _big(*tensors) -> bool:
    """Can an element offset (or a flat pixel number) pass int32?"""
    return any(max(t.numel(), sum((d - 1) * st for d, st in zip(t.shape, t.stride())) + 1) >= 2**31 - 1
               for t in tensors)


def max_pool2d(x: torch.Tensor, kernel, stride, padding, dilation, out: torch.Tensor,
               indices: torch.Tensor | None = None, tile: tuple[int, int, int] | None = None):
    n, c, h, w = x.shape
    oh, ow = out.shape[2:]
    if out.numel():
        bm, bc, warps = tile or _tile(c, x.stride(1))
        idx = indices if indices is not None else out
        window = idx.dtype != torch.int64
        if window and kernel[0] * kernel[1] > WINDOW_NOT_POSITIVE:
            raise ValueError(f"a {kernel[0]}x{kernel[1]} window has more taps than a window code holds")
        grid = (triton.cdiv(n * oh * ow, bm), triton.cdiv(c, bc))
        launch(max_pool2d_kernel, grid, x, out, idx, n, c, h, w, oh, ow, *x.stride(), *out.stride(), *idx.stride(),
               **_geometry(kernel, stride, padding, dilation), WITH_INDICES=indices is not None,
               WINDOW=window, BIG=_big(x, out, idx), BM=bm, BC=bc, num_warps=warps, **pdl_meta(x.device))
    return out, indices


def max_pool2d_backward(grad_out: torch.Tensor, indices: torch.Tensor, kernel, stride, padding, dilation,
                        grad_input: torch.Tensor, mask: torch.Tensor | None = None, threshold: float = 0.0,
                        mask_is_input: bool = False, tile: tuple[int, int, int] | None = None):
    """mask_is_input: the mask is the pool's input itself (the stem's relu output), so window codes' flag can
    stand in for it where the threshold is relu's (0)."""
    n, c, h, w = grad_input.shape
    oh, ow = grad_out.shape[2:]
    if grad_input.numel():
        bm, bc, warps = tile or _tile(c, grad_input.stride(1))
        window = indices.dtype != torch.int64
        sign = window and mask is not None and mask_is_input and threshold == 0.0
        m = mask if mask is not None and not sign else grad_input
        grid = (triton.cdiv(n * h * w, bm), triton.cdiv(c, bc))
        launch(max_pool2d_backward_kernel, grid, grad_out, indices, grad_input, m, n, c, h, w, oh, ow,
               *grad_out.stride(), *indices.stride(), *grad_input.stride(), *m.stride(), float(threshold),
               **_geometry(kernel, stride, padding, dilation),
               MASK=mask is not None and not sign, WINDOW=window, SIGN=sign,
               BIG=_big(grad_out, indices, grad_input, m), BM=bm, BC=bc, num_warps=warps,
               **pdl_meta(grad_out.device))
    return grad_input
