"""The host's time a call, layer by layer of torch.compile's machinery, on a model whose compute is negligible (CPU).

Entry point: `python bench/host_layers.py [--calls 400]`. At batch 1 a CUDA-graphed call is bound by the host
(BENCHMARKS.md), and most of that host time is torch's, paid by every peer: Dynamo's guards, then aot_autograd's
runtime wrappers, then the backend's callable. This builds HF ResNet-50's module structure (its 161 parameters and
4416 guards) with 8-channel stages on a 32 px image, so its ops cost little, and times a call of:
- the module itself (eager);
- torch.compile with the "eager" backend: Dynamo's guards and bytecode, then the captured graph's ops;
- torch.compile with "aot_eager": the same plus aot_autograd's wrappers around the graph;
each with all guards and with torch.compiler.skip_guard_on_all_nn_modules_unsafe. The steps between the rows are
the layers' costs on this host. Medians of --calls calls timed with perf_counter, in us.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import transformers


def per_call_us(fn, x, calls: int) -> float:
    times = []
    with torch.no_grad():
        for _ in range(20):
            fn(x)
        for _ in range(calls):
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 8, 8], depths=[3, 4, 6, 3])
    model = transformers.ResNetForImageClassification(cfg).eval()
    x = torch.randn(1, 3, 32, 32)
    rows = [("eager (the module)", lambda: model)]
    for backend in ("eager", "aot_eager"):
        for guards in (None, "skip_guard_on_all_nn_modules_unsafe"):
            options = {"guard_filter_fn": getattr(torch.compiler, guards)} if guards else None
            rows.append((f"backend={backend}, {guards or 'all guards'}",
                         lambda b=backend, o=options: torch.compile(model, backend=b, options=o)))
    print("HF ResNet-50's structure, 8 channels, 32 px, bs1: us a call")
    for name, make in rows:
        torch._dynamo.reset()
        print(f"  {name:<62} {per_call_us(make(), x, args.calls):8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
