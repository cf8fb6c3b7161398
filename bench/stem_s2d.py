"""GPU probe: ResNet's 7x7 stride-2 stem conv as a 4x4 stride-1 conv over the image's 2x2 space-to-depth.

Entry point: `python bench/stem_s2d.py [--batch 256 32 1] [--out DIR]`, on a GPU machine.

y[oh, ow] = sum_{r, s < 7} x'[2 oh + r, 2 ow + s] w[r, s], x' the image padded by 3. With r = 2a + p and s = 2b + q,
x'[2 (oh + a) + p, 2 (ow + b) + q] is channel (p, q, c) of X = pixel_unshuffle(x', 2) at (oh + a, ow + b): a
stride-1 4x4 conv over 12 channels (16 zero-padded), its weight w[k, c, 2a + p, 2b + q], zero at r or s = 7.
cuDNN runs the 3-channel stem on a first-layer kernel at 2.4x its memory floor (BENCHMARKS.md); a 16-channel
stride-1 conv is an ordinary implicit GEMM. Times (CUDA-graph replay, the tuner's timer, us) of: cuDNN on the
image padded to 4 channels (what resfuse runs now), the space-to-depth by torch ops, cuDNN on X (12 and 16
channels), and our Triton conv on X (heuristic config); each output against the fp32 reference.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402
from resfuse.tuning.choose import _bench  # noqa: E402

CL = torch.channels_last


def space_to_depth(x: torch.Tensor, channels: int) -> torch.Tensor:
    """X [N, channels, (H + 6) / 2, (W + 6) / 2], channels_last: the image padded by 3, 2x2 blocks as channels."""
    xp = F.pad(x, (3, 3, 3, 3))
    big = F.pixel_unshuffle(xp, 2)  # channel c * 4 + p * 2 + q
    if channels > big.shape[1]:
        big = F.pad(big, (0, 0, 0, 0, 0, channels - big.shape[1]))
    return big.contiguous(memory_format=CL)


def weight_s2d(w: torch.Tensor, channels: int) -> torch.Tensor:
    k, c, r, s = w.shape
    w8 = F.pad(w, (0, 8 - s, 0, 8 - r))  # [k, c, 8, 8]
    w4 = w8.view(k, c, 4, 2, 4, 2).permute(0, 1, 3, 5, 2, 4).reshape(k, c * 4, 4, 4)  # channel c * 4 + p * 2 + q
    if channels > w4.shape[1]:
        w4 = F.pad(w4, (0, 0, 0, 0, 0, channels - w4.shape[1]))
    return w4.contiguous(memory_format=CL)


def one_batch(batch: int) -> list[dict]:
    dev = "cuda"
    x = torch.randn(batch, 3, 224, 224, device=dev, dtype=torch.float16).contiguous(memory_format=CL)
    w = (torch.randn(64, 3, 7, 7, device=dev) * 0.2).half().contiguous(memory_format=CL)
    ref = F.conv2d(x.float(), w.float(), None, 2, 3)
    rows = []

    def row(name, fn):
        out = fn()
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        us = _bench(fn) * 1e6
        rows.append({"batch": batch, "variant": name, "us": us, "rel_err": err})
        print(f"bs{batch} {name}: {us:.1f} us, rel err {err:.1e}", flush=True)

    xp = torch.zeros(batch, 4, 224, 224, device=dev, dtype=torch.float16).contiguous(memory_format=CL)
    xp[:, :3] = x
    wp = torch.zeros(64, 4, 7, 7, device=dev, dtype=torch.float16).contiguous(memory_format=CL)
    wp[:, :3] = w
    row("cuDNN, 4 channels (now)", lambda: F.conv2d(xp, wp, None, 2, 3))
    row("cuDNN, 3 channels", lambda: F.conv2d(x, w, None, 2, 3))
    for ch in (12, 16):
        X, W = space_to_depth(x, ch), weight_s2d(w, ch)
        rows.append({"batch": batch, "variant": f"space-to-depth by torch ops, {ch} ch",
                     "us": _bench(lambda: space_to_depth(x, ch)) * 1e6})
        row(f"cuDNN on space-to-depth, {ch} ch", lambda: F.conv2d(X, W))
        if ch == 16:
            out = torch.empty_like(ref, dtype=torch.float16).contiguous(memory_format=CL)
            row("ours on space-to-depth, 16 ch",
                lambda: kernels.conv2d(X, W, [], "acc", [1, 1], [0, 0], [1, 1], out))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 32, 1])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    for b in args.batch:
        rows += one_batch(b)
        with open(os.path.join(args.out, "stem_s2d.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'bs':>4} {'variant':40} {'us':>9} {'rel err':>9}")
    for r in rows:
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        print(f"{r['batch']:>4} {r['variant']:40} {r['us']:9.1f} {err:>9}")


if __name__ == "__main__":
    main()
