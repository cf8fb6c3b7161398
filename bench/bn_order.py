"""Per-kernel GPU times of the training batch-norm passes (issue 6) as a network runs them: each call follows
a write of its input (what the conv before it leaves in L2) after a flush of L2, so the order in which the
passes walk the rows, and what each finds in L2, counts as it does in a training step.

Entry point: `python bench/bn_order.py [--batch 256] [--iters 20] [--out DIR]`, on a GPU machine.
For each batch-norm shape of ResNet-50 (channels_last): the forward (statistics, finalize, apply with a relu
epilogue) and the backward (partials, finalize, apply), us per call by kernel from torch.profiler, with
programmatic dependent launch off so that a kernel's duration is its own. Prints a per-step total by kernel
last (each shape times its count in the net); the rows go to DIR/bn_order.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from bn_kernels import resnet50_bn_shapes  # noqa: E402

from resfuse import kernels  # noqa: E402

OURS = ("bn_partials_kernel", "bn_finalize_kernel", "resfuse_batch_norm", "bnb_partials_kernel",
        "bnb_finalize_kernel", "bnb_apply_kernel")


def per_kernel(fn, iters: int) -> dict:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / iters for e in prof.key_averages() if e.key in OURS}


def one_shape(shape, iters: int) -> dict:
    n, c, h, w = shape
    cl = torch.channels_last
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).half().contiguous(memory_format=cl)
    g = torch.randn(shape, device="cuda").half().contiguous(memory_format=cl)
    wt, b = torch.rand(c, device="cuda") + 0.5, torch.randn(c, device="cuda")
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MB: L2 (50 MB) holds none of x or g
    y, mean, invstd, _, _ = kernels.batch_norm_train(x, wt, b, rm, rv, [], "relu(acc)", 0.1, 1e-5)
    dx = torch.empty_like(x)

    def fwd():
        flush.zero_()
        x.mul_(1.0)  # the producer: x written last, in order
        kernels.batch_norm_train(x, wt, b, rm, rv, [], "relu(acc)", 0.1, 1e-5, out=y)

    def bwd():
        flush.zero_()
        g.mul_(1.0)
        kernels.batch_norm_backward(g, x, wt, mean, invstd, (True, True, True), dx)

    return {"shape": list(shape), **per_kernel(fwd, iters), **per_kernel(bwd, iters)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    kernels.set_options(pdl=False)
    rows, total = [], collections.Counter()
    for shape, count in sorted(resnet50_bn_shapes(args.batch).items(), key=lambda kv: -kv[0][1]):
        row = one_shape(shape, args.iters)
        row["count"] = count
        rows.append(row)
        total.update({k: v * count for k, v in row.items() if k in OURS})
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bn_order.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\nper step, batch {args.batch}, us:")
    for k in OURS:
        print(f"  {k:22s} {total[k]:9.1f}")
    print(f"  {'forward':22s} {sum(total[k] for k in OURS[:3]):9.1f}")
    print(f"  {'backward':22s} {sum(total[k] for k in OURS[3:]):9.1f}")


if __name__ == "__main__":
    main()
