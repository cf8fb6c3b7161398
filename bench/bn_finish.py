"""Where the training batch-norm backward's finalize runs: in the partials pass (its last program per channel
block, elected by a ticket) or as a kernel of its own, on every batch-norm shape of ResNet-50.

Entry point: `python bench/bn_finish.py [--batch 256] [--rows 32,64,128] [--out DIR]`, on a GPU machine.
Each variant is checked against aten.native_batch_norm_backward, then timed with
triton.testing.do_bench_cudagraph (the call replayed in a CUDA graph, as training under graph trees runs it, so
the gap between kernels counts and the host's launches do not). Variants: "kernel" (bnb_finalize_kernel, the
path without tickets), and "partials/R" (the partials pass finishes, adding R splits a step). Prints each shape's
times and the per-step totals (each shape times its count) last; the rows go to DIR/bn_finish.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from unittest import mock

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402
from resfuse.kernels import batch_norm_bwd, tickets  # noqa: E402

from bn_kernels import rel_err, resnet50_bn_shapes  # noqa: E402


def one_shape(shape, rows: list[int]) -> dict:
    n, c, h, w = shape
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).half().contiguous(memory_format=torch.channels_last)
    g = torch.randn(shape, device="cuda").half().contiguous(memory_format=torch.channels_last)
    wt = torch.rand(c, device="cuda") + 0.5
    x32 = x.float()
    mean = x32.mean((0, 2, 3))
    invstd = (x32.var((0, 2, 3), unbiased=False) + 1e-5).rsqrt()
    dx = torch.empty_like(x)
    mask = (True, True, True)
    want = torch.ops.aten.native_batch_norm_backward(g, x, wt, None, None, mean, invstd, True, 1e-5, list(mask))

    def ours():
        return batch_norm_bwd.batch_norm_backward(g, x, wt, mean, invstd, mask, dx)

    ours()
    plan = next(p for p in batch_norm_bwd._PLANS.values() if p.m == n * h * w and p.c == c)
    row = {"shape": list(shape), "splits": plan.splits}
    default_rows = plan.finish_r
    variants = [("kernel", mock.patch.object(tickets, "take", lambda *a: None), default_rows)]
    variants += [(f"partials/{r}", contextlib.nullcontext(), r) for r in rows]
    for name, patch, r in variants:
        plan.finish_r = r
        with patch:
            got = ours()
            row[f"{name} err"] = max(rel_err(a, b) for a, b in zip(got, want))
            row[name] = do_bench_cudagraph(ours, rep=40) * 1e3
    plan.finish_r = default_rows
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rows", default="32,64,128")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    kernels.set_options(interpret=False)
    tickets.POOL = 1 << 24  # every call inside a capture takes tickets of its own; the graphs here capture thousands
    rows = [int(r) for r in args.rows.split(",")]
    shapes = resnet50_bn_shapes(args.batch)
    table = []
    for shape, count in sorted(shapes.items()):
        row = one_shape(shape, rows)
        row["count"] = count
        table.append(row)
        print({k: round(v, 2) if isinstance(v, float) and "err" not in k else v for k, v in row.items()}, flush=True)
    assert tickets._used[torch.device("cuda", torch.cuda.current_device())] < tickets.POOL, "the ticket pool ran out"
    names = ["kernel", *(f"partials/{r}" for r in rows)]
    totals = {name: sum(r[name] * r["count"] for r in table) for name in names}
    worst = {name: max(r[f"{name} err"] for r in table) for name in names}
    with open(os.path.join(args.out, "bn_finish.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "batch": args.batch, "rows": table, "totals_us": totals},
                  f, indent=1)
    print(f"\nResNet-50 bs{args.batch} batch-norm backwards, us a step (each shape times its count), {torch.cuda.get_device_name()}")
    for name in names:
        print(f"{name:>14s} {totals[name]:9.1f}  vs kernel {totals['kernel'] / totals[name]:5.3f}x  "
              f"max rel err {worst[name]:.1e}")


if __name__ == "__main__":
    main()
