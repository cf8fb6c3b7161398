"""GPU benchmark of the 3x3 conv mainloops (issue 3's target: within 1.2x of cuDNN's conv alone).

  python3 bench/conv3x3.py [--batches 32 256] [--out DIR]

For each stride-1 3x3 conv of ResNet-50 (fp16, channels_last) at each batch: cuDNN's conv alone (the target's
peer), then our fused kernel with no epilogue ("acc") and with the bn+relu epilogue, on the pointer mainloop
and on the TMA box mainloop (conv2d_tma_mainloop), each over a grid of tiles; and cuDNN's conv followed by the
unfused bn+relu (eager). Numerics are checked against an fp32 conv first. Times: each call replayed in a CUDA
graph (triton's do_bench_cudagraph), median, in microseconds. Prints a table (best config per mainloop); all
rows go to DIR/conv3x3.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402
from resfuse.kernels import launch  # noqa: E402
from resfuse.kernels.conv2d_fprop import ConvConfig  # noqa: E402

SHAPES = [("l1 3x3 64", 64, 56), ("l2 3x3 128", 128, 28), ("l3 3x3 256", 256, 14), ("l4 3x3 512", 512, 7)]
BN_RELU = "relu(bn[#1e-05](acc,c0,c1,c2,c3))"
TILES = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3),
         (256, 128, 64, 8, 3), (64, 64, 64, 4, 4)]  # the tuner's fast level's tiles (tuning/space.py)


def bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=30) * 1e3


def one(name: str, c: int, hw: int, n: int) -> list[dict]:
    cl = torch.channels_last
    x = torch.randn(n, c, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = (torch.randn(c, c, 3, 3, device="cuda", dtype=torch.float16) / (9 * c) ** 0.5).contiguous(memory_format=cl)
    vecs = [torch.randn(c, device="cuda"), torch.rand(c, device="cuda") + 0.5, torch.randn(c, device="cuda"),
            torch.randn(c, device="cuda")]
    out = torch.empty(n, c, hw, hw, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    ref = F.conv2d(x.float(), w.float(), None, 1, 1)
    rows = [{"case": name, "batch": n, "impl": "cudnn conv alone", "us": bench(lambda: F.conv2d(x, w, None, 1, 1))}]
    rows.append({"case": name, "batch": n, "impl": "cudnn + eager bn, relu", "us": bench(
        lambda: torch.relu(F.batch_norm(F.conv2d(x, w, None, 1, 1), *vecs, False, 0.0, 1e-5)))})
    for tma in (False, True):
        for tile in TILES:
            cfg = ConvConfig(*tile[:3], 8, 1, False, tile[3], tile[4], tma)
            try:
                launch._PLANS.clear()
                kernels.conv2d(x, w, [], "acc", [1, 1], [1, 1], [1, 1], out, cfg)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if err > 1e-2:
                    raise AssertionError(f"relative error {err:.2e}")
                us = bench(lambda: kernels.conv2d(x, w, [], "acc", [1, 1], [1, 1], [1, 1], out, cfg))
                ops = [v.view(-1, 1, 1) for v in vecs]
                us_epi = bench(lambda: kernels.conv2d(x, w, ops, BN_RELU, [1, 1], [1, 1], [1, 1], out, cfg))
                rows.append({"case": name, "batch": n, "impl": "tma" if tma else "pointer",
                             "config": dataclasses.asdict(cfg), "us": us, "us_bn_relu": us_epi})
            except Exception as e:  # noqa: BLE001  (a config that does not compile or fit: recorded, skipped)
                rows.append({"case": name, "batch": n, "impl": "tma" if tma else "pointer",
                             "config": dataclasses.asdict(cfg), "error": f"{type(e).__name__}: {str(e)[:200]}"})
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    rows = []
    for n in args.batches:
        for shape in SHAPES:
            rows += one(*shape, n)
            with open(os.path.join(args.out, "conv3x3.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"ResNet-50 stride-1 3x3 convs, fp16 channels_last, {torch.cuda.get_device_name()}; us (ratio to cuDNN)")
    for n in args.batches:
        for name, _, _ in SHAPES:
            mine = [r for r in rows if r["case"] == name and r["batch"] == n]
            cudnn = next(r["us"] for r in mine if r["impl"] == "cudnn conv alone")
            eager = next(r["us"] for r in mine if r["impl"].startswith("cudnn +"))
            line = f"bs{n:<4} {name:12s} cudnn {cudnn:8.1f}  cudnn+eager bn,relu {eager:8.1f}"
            for impl in ("pointer", "tma"):
                ok = [r for r in mine if r["impl"] == impl and "us" in r]
                if ok:
                    best = min(ok, key=lambda r: r["us"])
                    c = best["config"]
                    line += (f"  {impl} {best['us']:8.1f} ({best['us'] / cudnn:.2f}x; +bn,relu "
                             f"{best['us_bn_relu']:.1f}) {c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']}")
                errs = [r["error"] for r in mine if r["impl"] == impl and "error" in r]
                if errs:
                    line += f" [{len(errs)} {impl} configs failed: {errs[0][:80]}]"
            print(line)


if __name__ == "__main__":
    main()
