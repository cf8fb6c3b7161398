"""GPU benchmark of the inference stem as one kernel: conv 7x7 s2 + batch norm + relu + max-pool 3x3 s2 (ResNet's).

Entry point: `python bench/stem_pool.py [--batch 256 32 1] [--sweep] [--out DIR]`, on a GPU machine. For each batch,
fp16 channels_last, against the fp32 reference (max relative error):
  separate:   what resfuse runs: the image padded to 4 channels (resfuse::pad_channels), cuDNN's bare conv,
              and the max-pool evaluating batch norm + relu at each window's extremes (max_pool2d_epilogue);
  cudnn3:     the same without the padding (cuDNN pads itself);
  folded:     (--folded) the image padded, the conv with its batch norm folded into the weight and relu, as a
              cuDNN graph (the cudnn provider's cudnn+fold_bn candidates, each engine config), then the plain
              max-pool: what runs if the pool does not take the conv's epilogue (C = 4, and C = 3 unpadded);
  ours:       the probe kernel of bench/stem_kernel.py, every config of its fast list (--sweep: its whole
              space; --configs N: the first N).
Times: each variant replayed from a CUDA graph (the tuner's timer), us. Prints a table last; the rows go to
DIR/stem_pool.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402
import stem_kernel  # noqa: E402  (bench/ is sys.path[0])
from resfuse.tuning.choose import _bench  # noqa: E402

SIG = "relu(bn[#1e-05](acc,c0,c1,c2,c3))"
POOL = ([3, 3], [2, 2], [1, 1], [1, 1], False)
CONV = ([2, 2], [3, 3], [1, 1])


def rel(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def one_batch(batch: int, sweep: bool, limit: int | None, folded_too: bool) -> list[dict]:
    dev = "cuda"
    x = torch.randn(batch, 3, 224, 224, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(64, 3, 7, 7, device=dev) * 0.2).half().contiguous(memory_format=torch.channels_last)
    ops = [torch.randn(64, device=dev).half() * 0.1, torch.rand(64, device=dev).half() + 0.5,
           torch.randn(64, device=dev).half(), torch.randn(64, device=dev).half()]
    y = F.conv2d(x.float(), w.float(), None, *CONV)
    ref = F.max_pool2d(F.relu(F.batch_norm(y, *[o.float() for o in ops], False, 0.0, 1e-5)), 3, 2, 1)
    out = torch.empty(ref.shape, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    rows = []

    def row(name, fn, **extra):
        out.fill_(float("nan"))
        start = time.time()
        try:
            fn()
            torch.cuda.synchronize()
            first_s = time.time() - start
            err = rel(out, ref)
            us = _bench(fn) * 1e6
        except Exception as e:  # noqa: BLE001 - a config that fails to build is a row, not a crash
            rows.append({"batch": batch, "variant": name, "error": f"{type(e).__name__}: {e}"[:200], **extra})
            print(f"bs{batch} {name} {extra} failed: {rows[-1]['error']}", flush=True)
            return
        rows.append({"batch": batch, "variant": name, "us": us, "rel_err": err, "first_s": first_s, **extra})
        print(f"bs{batch} {name} {extra} {us:.1f} us, rel err {err:.1e}, first call {first_s:.1f} s", flush=True)

    xp = torch.empty(batch, 4, 224, 224, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    wp = torch.zeros(64, 4, 7, 7, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    wp[:, :3] = w

    def separate():
        kernels.pad_channels(x, xp)
        conv = torch.ops.aten.convolution(xp, wp, None, *CONV, False, [0, 0], 1)
        kernels.max_pool2d_epilogue(conv, ops, SIG, *POOL[:4], out)

    def cudnn3():
        conv = torch.ops.aten.convolution(x, w, None, *CONV, False, [0, 0], 1)
        kernels.max_pool2d_epilogue(conv, ops, SIG, *POOL[:4], out)

    row("separate", separate)
    row("cudnn3", cudnn3)
    from resfuse.ops.fused import call_of
    from resfuse.providers import cudnn
    for name, image, weight in (("folded C=4", xp, wp), ("folded C=3", x, w)) if folded_too else ():
        call = call_of("conv2d", (image, weight), ops, SIG, CONV)
        for cand in cudnn.candidates(call, "fast"):
            def folded(cand=cand, image=image):
                if image is xp:
                    kernels.pad_channels(x, xp)
                y = cand.run()
                kernels.max_pool2d(y, *POOL[:4], out)
            row(f"{name} {cand.name}", folded)
            rows.append({"batch": batch, "variant": f"  its conv alone {cand.name}", "us": _bench(cand.run) * 1e6})

    conv_only = torch.ops.aten.convolution(xp, wp, None, *CONV, False, [0, 0], 1)
    rows.append({"batch": batch, "variant": "cuDNN conv alone (C=4)",
                 "us": _bench(lambda: torch.ops.aten.convolution(xp, wp, None, *CONV, False, [0, 0], 1)) * 1e6})
    rows.append({"batch": batch, "variant": "plain pool alone",
                 "us": _bench(lambda: kernels.max_pool2d(conv_only, *POOL[:4], out)) * 1e6})
    rows.append({"batch": batch, "variant": "pool with epilogue alone",
                 "us": _bench(lambda: kernels.max_pool2d_epilogue(conv_only, ops, SIG, *POOL[:4], out)) * 1e6})
    if sweep:
        space = stem_kernel.SPACE
        configs = [stem_kernel.PoolConfig(**dict(zip(space, v))) for v in itertools.product(*space.values())]
        configs = [c for c in configs if c.check(POOL)]
    else:
        configs = stem_kernel.fast_configs(64)
    for cfg in configs[:limit]:
        row("ours", lambda cfg=cfg: stem_kernel.conv2d_max_pool(x, w, ops, SIG, *CONV, POOL, out, cfg),
            config=dataclasses.asdict(cfg))
    # floor: the image read once, the pooled output written once (bytes), or the conv's FLOPs at 686 TFLOP/s
    floor = max((x.numel() + out.numel()) * 2 / 3.0e12, 2 * y.numel() * 147 / 686e12) * 1e6
    rows.append({"batch": batch, "variant": "floor", "us": floor})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 32, 1])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--configs", type=int, default=None, help="time only the first N configs")
    parser.add_argument("--folded", action="store_true", help="also the folded cuDNN conv + plain pool")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    for b in args.batch:
        rows += one_batch(b, args.sweep, args.configs, args.folded)
        with open(os.path.join(args.out, "stem_pool.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'bs':>4} {'variant':28} {'us':>9} {'rel err':>9}  config")
    for b in args.batch:
        mine = [r for r in rows if r["batch"] == b]
        ours = sorted((r for r in mine if r["variant"] == "ours" and "us" in r), key=lambda r: r["us"])
        shown = [r for r in mine if r["variant"] != "ours"] + ours[:6]
        for r in shown:
            cfg = r.get("config")
            cfg = "" if cfg is None else " ".join(f"{k}={v}" for k, v in cfg.items())
            err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
            us = f"{r['us']:9.1f}" if "us" in r else r.get("error", "")[:60]
            print(f"{b:>4} {r['variant']:28} {us:>9} {err:>9}  {cfg}")
        failed = [r for r in mine if "error" in r]
        if failed:
            print(f"     {len(failed)} variant(s) failed, first: {failed[0]['error'][:150]}")


if __name__ == "__main__":
    main()
