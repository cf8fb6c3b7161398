"""GPU benchmark of the TMA mainloops: 3x3 convs against cuDNN (issue 3's target: within 1.2x of cuDNN's conv
alone) and BERT-base GEMMs against cuBLAS (within 1.1x), with and without Triton's warp specialisation.

  python3 bench/conv3x3.py [--batches 32 256] [--out DIR]

For each stride-1 3x3 conv of ResNet-50 (fp16, channels_last) at each batch: cuDNN's conv alone (the target's
peer), then our fused kernel with no epilogue ("acc") and with the bn+relu epilogue, on the pointer mainloop
and on the TMA box mainloop (conv2d_tma_mainloop), each over a grid of tiles; and cuDNN's conv followed by the
unfused bn+relu (eager). "tma+ws" is the TMA mainloop with its loop warp-specialised. Then the BERT-base GEMMs
(32 x 384 tokens) bare: cuBLAS's mm against our TMA GEMM mainloop, with and without warp specialisation.
Numerics are checked against fp32 first. Times: each call replayed in a CUDA
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
    for impl in ("pointer", "tma", "tma+ws"):
        for tile in TILES:
            cfg = ConvConfig(*tile[:3], 8, 1, False, tile[3], tile[4], impl != "pointer", impl == "tma+ws")
            try:
                launch._PLANS.clear()
                kernels.conv2d(x, w, [], "acc", [1, 1], [1, 1], [1, 1], out, cfg)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if err > 1e-2:
                    raise AssertionError(f"relative error {err:.2e}")
                us = bench(lambda: kernels.conv2d(x, w, [], "acc", [1, 1], [1, 1], [1, 1], out, cfg))
                ops = [v.view(-1, 1, 1) for v in vecs]
                us_epi = bench(lambda: kernels.conv2d(x, w, ops, BN_RELU, [1, 1], [1, 1], [1, 1], out, cfg))
                rows.append({"case": name, "batch": n, "impl": impl, "config": dataclasses.asdict(cfg), "us": us,
                             "us_bn_relu": us_epi})
            except Exception as e:  # noqa: BLE001  (a config that does not compile or fit: recorded, skipped)
                rows.append({"case": name, "batch": n, "impl": impl, "config": dataclasses.asdict(cfg),
                             "error": f"{type(e).__name__}: {str(e)[:200]}"})
    return rows


GEMMS = [("qkv 768>768", 12288, 768, 768), ("ffn1 768>3072", 12288, 3072, 768), ("ffn2 3072>768", 12288, 768, 3072)]
GEMM_TILES = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (256, 128, 64, 8, 3),
              (128, 256, 64, 8, 4), (64, 256, 64, 4, 4)]


def gemm_rows() -> list[dict]:
    from resfuse.kernels.matmul import GemmConfig

    rows = []
    for name, m, n, k in GEMMS:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.float16) / k ** 0.5).t()  # a linear layer's weight
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        ref = a.float() @ b.float()
        rows.append({"case": name, "impl": "cublas", "us": bench(lambda: torch.mm(a, b))})
        for ws in (False, True):
            for tile in GEMM_TILES:
                cfg = GemmConfig(*tile[:3], 8, 1, tile[3], tile[4], True, ws)
                impl = "tma+ws" if ws else "tma"
                try:
                    launch._PLANS.clear()
                    kernels.gemm(a, b, [], "acc", out, cfg)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        raise AssertionError(f"relative error {err:.2e}")
                    rows.append({"case": name, "impl": impl, "config": dataclasses.asdict(cfg),
                                 "us": bench(lambda: kernels.gemm(a, b, [], "acc", out, cfg))})
                except Exception as e:  # noqa: BLE001
                    rows.append({"case": name, "impl": impl, "config": dataclasses.asdict(cfg),
                                 "error": f"{type(e).__name__}: {str(e)[:200]}"})
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    rows = gemm_rows()
    for n in args.batches:
        for shape in SHAPES:
            rows += one(*shape, n)
            with open(os.path.join(args.out, "conv3x3.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("BERT-base GEMMs (12288 tokens), fp16, bare; us (ratio to cuBLAS)")
    for name, *_ in GEMMS:
        mine = [r for r in rows if r["case"] == name]
        cublas = next(r["us"] for r in mine if r["impl"] == "cublas")
        line = f"{name:14s} cublas {cublas:8.1f}"
        for impl in ("tma", "tma+ws"):
            ok = [r for r in mine if r["impl"] == impl and "us" in r]
            if ok:
                best = min(ok, key=lambda r: r["us"])
                c = best["config"]
                line += f"  {impl} {best['us']:8.1f} ({best['us'] / cublas:.2f}x) {c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']}"
            errs = [r["error"] for r in mine if r["impl"] == impl and "error" in r]
            if errs:
                line += f" [{len(errs)} failed: {errs[0][:80]}]"
        print(line)
    print(f"ResNet-50 stride-1 3x3 convs, fp16 channels_last, {torch.cuda.get_device_name()}; us (ratio to cuDNN)")
    for n in args.batches:
        for name, _, _ in SHAPES:
            mine = [r for r in rows if r["case"] == name and r["batch"] == n]
            cudnn = next(r["us"] for r in mine if r["impl"] == "cudnn conv alone")
            eager = next(r["us"] for r in mine if r["impl"].startswith("cudnn +"))
            line = f"bs{n:<4} {name:12s} cudnn {cudnn:8.1f}  cudnn+eager bn,relu {eager:8.1f}"
            for impl in ("pointer", "tma", "tma+ws"):
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
