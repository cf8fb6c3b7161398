"""GPU probe: the stem conv (7x7 s2, 3 > 64 channels) as an implicit GEMM whose im2col rows are overlapping views.

  python bench/stem_rows.py [--batch 256 32 1] [--out DIR]

Padded once to 4 channels and by 3 pixels on every side (width rounded up to a multiple of 4, so that an image row
is a multiple of 16 bytes), the image makes the conv's operand A for filter row r an overlapping strided view: for
the output pixel (n, oh, ow), the 7 taps x 4 channels of filter row r are 28 consecutive halves starting at pixel
2*ow of padded row 2*oh + r, a 16-byte aligned address. So A_r is loaded with 16-byte vector loads (rows 16 bytes
apart, each 64 bytes: 28 used, the 4 beyond zeroed by a select), and the conv is 7 dots of K = 32 against a packed
weight [7, 32, 64]. cuDNN's first-layer kernel runs at about 2.4x its floor at bs256 (BENCHMARKS.md, twenty-seventh
session); a Triton probe of conv + pool (bench/stem_kernel.py) lost to it, gathering scalar halves.

Variants, each checked against the fp32 conv (relative error), timed by CUDA-graph replay (the tuner's timer), us:
  cudnn:        what resfuse ran before image_conv: the image padded to 4 channels (resfuse::pad_channels), cuDNN's
                bare conv (at batches under a million pixels, cuDNN's conv on the 3-channel image: "cudnn 3
                channels");
  product:      kernels/conv2d_image.py as resfuse::image_conv runs it (pad and pack, conv), the probe's "rows";
  rows:         the image padded spatially too (by the same pad kernel into the interior of a zeroed buffer: the
                border is zeroed once here, so the time is a lower bound for a kernel that writes it), the probe's
                conv, bare, over a grid of tiles;
  rows+bn,relu: the same with the batch norm + relu epilogue (scale and shift).
Prints a table last; rows go to DIR/stem_rows.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402
from resfuse.tuning.choose import _bench  # noqa: E402

R, KP, PAD, STRIDE, C4 = 7, 32, 3, 2, 4


@triton.jit
def stem_rows_kernel(x, w, y, scale, shift, M, OHW, OW, s_xn, s_xh,
                     R: tl.constexpr, KR: tl.constexpr, KP: tl.constexpr, STRIDE: tl.constexpr, C: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, EPI: tl.constexpr, STAGES: tl.constexpr):
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = m // OHW
    rem = m - n * OHW
    oh = rem // OW
    ow = rem - oh * OW
    base = tl.multiple_of(n.to(tl.int64) * s_xn + (oh * STRIDE) * s_xh + ow * (STRIDE * C), 8)
    k = tl.arange(0, KP)
    co = tl.arange(0, BN)
    ok = (m < M)[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r in tl.range(0, R, num_stages=STAGES):
        a = tl.load(x + base[:, None] + r * s_xh + k[None, :], mask=ok, other=0.0)
        a = tl.where((k < KR)[None, :], a, 0.0)
        b = tl.load(w + r * (KP * BN) + k[:, None] * BN + co[None, :])
        acc = tl.dot(a, b, acc)
    if EPI:
        acc = tl.maximum(acc * tl.load(scale + co)[None, :] + tl.load(shift + co)[None, :], 0.0)
    tl.store(y + m[:, None] * BN + co[None, :], acc.to(y.dtype.element_ty), mask=ok)


@triton.jit
def stem_rows_tma_kernel(a_desc, w, y_desc, scale, shift, rows, OH, HP,
                         R: tl.constexpr, KP: tl.constexpr, STRIDE: tl.constexpr, BW: tl.constexpr,
                         BN: tl.constexpr, EPI: tl.constexpr, STAGES: tl.constexpr):
    """One program per output row (n, oh), persistent: A_r is a TMA box of an overlapping view of the padded
    image ([rows of the image, output columns at 16 bytes, 28 halves]; the box's last 4 halves are out of bounds,
    so zero-filled), the output a box of [n * OH + oh, columns, channels]."""
    k = tl.arange(0, KP)
    co = tl.arange(0, BN)
    for row in tl.range(tl.program_id(0), rows, tl.num_programs(0)):
        n = row // OH
        oh = row - n * OH
        acc = tl.zeros((BW, BN), dtype=tl.float32)
        for r in tl.range(0, R, num_stages=STAGES):
            a = a_desc.load([n * HP + oh * STRIDE + r, 0, 0]).reshape(BW, KP)
            b = tl.load(w + r * (KP * BN) + k[:, None] * BN + co[None, :])
            acc = tl.dot(a, b, acc)
        if EPI:
            acc = tl.maximum(acc * tl.load(scale + co)[None, :] + tl.load(shift + co)[None, :], 0.0)
        y_desc.store([row, 0, 0], acc.to(y_desc.dtype).reshape(1, BW, BN))


@triton.jit
def stem_shot_kernel(x, w, y, scale, shift, M, OHW, OW, s_xn, s_xh, tiles,
                     R: tl.constexpr, KR: tl.constexpr, KP: tl.constexpr, STRIDE: tl.constexpr, C: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, EPI: tl.constexpr, HOIST: tl.constexpr):
    """The whole reduction as one dot: A [BM, 8 * 32] (filter rows 0..7; row 7 and the last 4 halves of each row
    meet zero weights, and are zeroed by a select), loaded at once; persistent over tiles, the packed weight
    [8 * 32, BN] loaded once a program where HOIST."""
    kk = tl.arange(0, 8 * KP)
    co = tl.arange(0, BN)
    koff = (kk // KP) * s_xh + kk % KP
    keep = ((kk % KP) < KR) & ((kk // KP) < R)
    if HOIST:
        b = tl.load(w + kk[:, None] * BN + co[None, :])
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0)):
        m = tile * BM + tl.arange(0, BM)
        n = m // OHW
        rem = m - n * OHW
        oh = rem // OW
        ow = rem - oh * OW
        base = tl.multiple_of(n.to(tl.int64) * s_xn + (oh * STRIDE) * s_xh + ow * (STRIDE * C), 8)
        ok = (m < M)[:, None]
        a = tl.load(x + base[:, None] + koff[None, :], mask=ok, other=0.0)
        a = tl.where(keep[None, :], a, 0.0)
        if not HOIST:
            b = tl.load(w + kk[:, None] * BN + co[None, :])
        acc = tl.dot(a, b)
        if EPI:
            acc = tl.maximum(acc * tl.load(scale + co)[None, :] + tl.load(shift + co)[None, :], 0.0)
        tl.store(y + m[:, None] * BN + co[None, :], acc.to(y.dtype.element_ty), mask=ok)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """[K, 3, 7, 7] -> [7 (r), 32 (s * 4 + c, zeros past 28 and in channel 3), K]."""
    k, c, r, s = w.shape
    wp = torch.zeros(r, s, C4, k, device=w.device, dtype=w.dtype)
    wp[:, :, :c] = w.permute(2, 3, 1, 0)
    return torch.cat([wp.reshape(r, s * C4, k), wp.new_zeros(r, KP - s * C4, k)], 1).contiguous()


def padded_image(n: int, h: int, w: int, dev) -> torch.Tensor:
    wp = (w + 2 * PAD + 3) // 4 * 4
    return torch.zeros(n, h + 2 * PAD, wp, C4, device=dev, dtype=torch.float16)


def stem_rows(xp, wpk, y, scale, shift, epi, bm, warps, stages):
    n, oh, ow, k = y.shape[0], y.shape[2], y.shape[3], y.shape[1]
    m = n * oh * ow
    stem_rows_kernel[(triton.cdiv(m, bm),)](
        xp, wpk, y, scale, shift, m, oh * ow, ow, xp.stride(0), xp.stride(1), R=R, KR=R * C4, KP=KP,
        STRIDE=STRIDE, C=C4, BM=bm, BN=k, EPI=epi, STAGES=stages, num_warps=warps)


def stem_shot(xp, wpk8, y, scale, shift, epi, bm, warps, progs, hoist):
    n, k, oh, ow = y.shape
    m = n * oh * ow
    tiles = triton.cdiv(m, bm)
    stem_shot_kernel[(min(tiles, progs),)](
        xp, wpk8, y, scale, shift, m, oh * ow, ow, xp.stride(0), xp.stride(1), tiles, R=R, KR=R * C4, KP=KP,
        STRIDE=STRIDE, C=C4, BM=bm, BN=k, EPI=epi, HOIST=hoist, num_warps=warps)


def stem_rows_tma(xp, wpk, y, scale, shift, epi, progs, stages):
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, k, oh, ow = y.shape
    bw = triton.next_power_of_2(ow)
    a = TensorDescriptor(xp, [n * xp.shape[1], ow, R * C4], [xp.stride(1), STRIDE * C4, 1], [1, bw, KP])
    out = TensorDescriptor(y, [n * oh, ow, k], [ow * k, k, 1], [1, bw, k])
    stem_rows_tma_kernel[(min(n * oh, progs),)](a, wpk, out, scale, shift, n * oh, oh, xp.shape[1], R=R, KP=KP,
                                                 STRIDE=STRIDE, BW=bw, BN=k, EPI=epi, STAGES=stages, num_warps=4)


def one_batch(batch: int) -> list[dict]:
    dev = "cuda"
    x = torch.randn(batch, 3, 224, 224, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(64, 3, 7, 7, device=dev) * 0.2).half().contiguous(memory_format=torch.channels_last)
    scale, shift = torch.rand(64, device=dev) + 0.5, torch.randn(64, device=dev)
    ref = F.conv2d(x.float(), w.float(), None, 2, 3)
    ref_bn = F.relu(ref * scale[:, None, None] + shift[:, None, None])
    y = torch.empty(ref.shape, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    x4 = torch.empty(batch, 4, 224, 224, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w4 = torch.zeros(64, 4, 7, 7, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w4[:, :3] = w
    xp = padded_image(batch, 224, 224, dev)
    interior = xp[:, PAD:PAD + 224, PAD:PAD + 224].permute(0, 3, 1, 2)  # NCHW view of the padded NHWC buffer
    wpk = pack_weight(w)
    rows = []

    def row(name, fn, want, **extra):
        y.fill_(float("nan"))
        try:
            out = fn()
            torch.cuda.synchronize()
            err = ((out.float() - want).norm() / want.norm()).item()
            us = _bench(fn) * 1e6
        except Exception as e:  # noqa: BLE001 - a config that fails to build is a row, not a crash
            rows.append({"batch": batch, "variant": name, "error": f"{type(e).__name__}: {e}"[:300], **extra})
            print(f"bs{batch} {name} {extra} failed: {rows[-1]['error']}", flush=True)
            return
        rows.append({"batch": batch, "variant": name, "us": us, "rel_err": err, **extra})
        print(f"bs{batch} {name} {extra} {us:.1f} us, rel err {err:.1e}", flush=True)

    def cudnn():
        kernels.pad_channels(x, x4)
        return torch.ops.aten.convolution(x4, w4, None, [2, 2], [3, 3], [1, 1], False, [0, 0], 1)

    row("cudnn", cudnn, ref)
    row("product", lambda: kernels.image_conv(x, w, (2, 2), (3, 3), y), ref)  # resfuse::image_conv's kernels
    row("cudnn 3 channels", lambda: torch.ops.aten.convolution(x, w, None, [2, 2], [3, 3], [1, 1], False, [0, 0], 1),
        ref)
    row("cudnn conv alone", lambda: torch.ops.aten.convolution(x4, w4, None, [2, 2], [3, 3], [1, 1], False,
                                                                [0, 0], 1), ref)
    row("pad 3>4 alone", lambda: (kernels.pad_channels(x, x4), ref)[1], ref)
    row("pad spatial alone", lambda: (kernels.pad_channels(x, interior), ref)[1], ref)
    for epi in (False, True):
        for bm, warps, stages in ((64, 4, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2), (128, 4, 1),
                                  (256, 8, 3), (64, 2, 2)):
            def fn(bm=bm, warps=warps, stages=stages, epi=epi):
                kernels.pad_channels(x, interior)
                stem_rows(xp, wpk, y, scale, shift, epi, bm, warps, stages)
                return y
            row("rows+bn,relu" if epi else "rows", fn, ref_bn if epi else ref, bm=bm, warps=warps, stages=stages)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    wpk8 = torch.cat([wpk, wpk.new_zeros(1, KP, 64)]).contiguous()  # a zero filter row 7
    for epi in (False, True):
        for bm, warps, progs, hoist in ((64, 4, 1 << 30, False), (128, 8, 1 << 30, False), (64, 4, 4 * sms, True),
                                        (64, 4, 8 * sms, True), (128, 8, 2 * sms, True), (128, 8, 4 * sms, True),
                                        (32, 4, 8 * sms, True)):
            def fn(bm=bm, warps=warps, progs=progs, hoist=hoist, epi=epi):
                kernels.pad_channels(x, interior)
                stem_shot(xp, wpk8, y, scale, shift, epi, bm, warps, progs, hoist)
                return y
            row("shot+bn,relu" if epi else "shot", fn, ref_bn if epi else ref, bm=bm, warps=warps, progs=progs,
                hoist=hoist)
    for epi in (False, True):
        for progs, stages in ((sms, 2), (2 * sms, 2), (4 * sms, 2), (2 * sms, 3), (1 << 30, 2)):
            def fn(progs=progs, stages=stages, epi=epi):
                kernels.pad_channels(x, interior)
                stem_rows_tma(xp, wpk, y, scale, shift, epi, progs, stages)
                return y
            row("tma+bn,relu" if epi else "tma", fn, ref_bn if epi else ref, progs=progs, stages=stages)
    # floor: image read + conv output written (bytes at 3.0 TB/s), or the conv's FLOPs (K = 147) at 756 TFLOP/s
    floor = max((x.numel() + y.numel()) * 2 / 3.0e12, 2 * y.numel() * 147 / 756e12) * 1e6
    rows.append({"batch": batch, "variant": "floor", "us": floor})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 32, 1])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    for b in args.batch:
        rows += one_batch(b)
        with open(os.path.join(args.out, "stem_rows.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'bs':>4} {'variant':20} {'us':>9} {'rel err':>9}  config")
    for b in args.batch:
        mine = [r for r in rows if r["batch"] == b and "us" in r]
        fixed = [r for r in mine if not r["variant"].startswith(("rows", "tma", "shot"))]
        best = [min((r for r in mine if r["variant"] == v), key=lambda r: r["us"], default=None)
                for v in ("rows", "rows+bn,relu", "tma", "tma+bn,relu", "shot", "shot+bn,relu")]
        for r in fixed + [r for r in best if r]:
            cfg = " ".join(f"{k}={r[k]}" for k in ("bm", "warps", "progs", "stages", "hoist") if k in r)
            print(f"{b:>4} {r['variant']:20} {r['us']:9.1f} {r.get('rel_err', float('nan')):9.1e}  {cfg}")


if __name__ == "__main__":
    main()
