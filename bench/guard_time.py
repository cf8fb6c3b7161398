"""The host time Dynamo's guards take a call, with each of torch.compiler's guard filters (CPU or GPU machine).

Entry point: `python bench/guard_time.py [--model hf-resnet50] [--batch 1] [--device cpu] [--by-type]`. At batch 1 a
CUDA-graphed call is bound by the host (BENCHMARKS.md), and every call of a compiled model first checks Dynamo's
guards. This compiles the model with torch.compile's "eager" backend (the guards do not depend on the backend;
eager's keeps the run short) under each filter, and reads the profiler's "TorchDynamo Cache Lookup" event: the
guards' time per call. The filters are torch's own, passed as torch.compile's guard_filter_fn (resfuse.compile takes
it as guard_filter_fn=, bench/ab.py as guards=NAME).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from resfuse.bench import models  # noqa: E402

FILTERS = (None, "keep_tensor_guards_unsafe", "skip_guard_on_all_nn_modules_unsafe")


def lookup_us(fn, inputs, calls: int) -> float:
    with torch.no_grad():
        for _ in range(5):
            fn(*inputs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                fn(*inputs)
    found = [e for e in prof.key_averages() if "Cache Lookup" in e.key]
    return found[0].cpu_time_total / found[0].count if found else float("nan")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="hf-resnet50")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--image-size", type=int, default=32, help="small: only the guards are timed")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--by-type", action="store_true",
                   help="also count the guards by type, and time the guards without each of the commonest types")
    args = p.parse_args()
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    model, inputs = models.load(args.model, args.batch, dtype, args.device, image_size=args.image_size, seq=16)
    print(f"{args.model} bs{args.batch} on {args.device}: Dynamo's guards, us a call")
    for name in FILTERS:
        torch._dynamo.reset()
        options = {"guard_filter_fn": getattr(torch.compiler, name)} if name else None
        fn = torch.compile(model, backend="eager", options=options)
        print(f"  {name or 'all guards (the default)':<40} {lookup_us(fn, inputs, args.calls):8.1f}", flush=True)
    if args.by_type:
        by_type(model, inputs, args.calls)
    return 0


def by_type(model, inputs, calls: int) -> None:
    """How many guards of each type the model gets, and the guards' time without each of the five commonest
    (not a safe filter: each type dropped is something a later change to the model would not be checked for)."""
    seen = []

    def spy(entries):
        seen.extend(entries)
        return [True] * len(entries)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="eager", options={"guard_filter_fn": spy})(*inputs)
    counts = collections.Counter(e.guard_type for e in seen)
    print(f"  {len(seen)} guards: " + ", ".join(f"{t} {n}" for t, n in counts.most_common()))
    for kind, _ in counts.most_common(5):
        torch._dynamo.reset()
        fn = torch.compile(model, backend="eager", options={"guard_filter_fn": lambda entries, kind=kind: [
            e.guard_type != kind for e in entries]})
        print(f"  without {kind:<34} {lookup_us(fn, inputs, calls):8.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
