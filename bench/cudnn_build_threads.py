"""Do cuDNN's engine builds run in parallel on threads? (GPU machine; a probe for cold tuning)

Entry point: `python bench/cudnn_build_threads.py --model resnet50 --batch 32 --threads N [--out DIR]`.
Captures the model's rewritten inference graph (resfuse.explain: nothing runs or tunes), makes the cuDNN
provider's plans for every fused conv and GEMM the tuner would measure (graph + heuristics, on one thread), then
builds the engine configs the "fast" level times (the first ENGINES["fast"] of each plan) on N threads, a plan
per task (each plan has its own handle). Prints the wall time of each phase and writes DIR/cudnn_build_threads.json.

A cold ResNet-50 bs32 tuning spent 33 of its 89 s in these builds (BENCHMARKS.md). Run each thread count in its
own process with a fresh CUDA_CACHE_PATH: a second process on the same machine built them about 10x faster.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    import resfuse
    from resfuse import providers
    from resfuse.bench import models
    from resfuse.capture import backend
    from resfuse.providers import cudnn
    from resfuse.tuning import choose, precompile

    graphs, run_passes = [], backend.run_passes
    backend.run_passes = lambda gm, ctx: graphs.append(run_passes(gm, ctx)) or graphs[-1]  # the rewritten graph
    model, example = models.load(args.model, args.batch, torch.float16, "cuda")
    with torch.no_grad():
        resfuse.explain(model, *example, cache_dir=tempfile.mkdtemp(prefix="resfuse_probe_"))
    seen, calls = set(), []
    for gm in graphs:
        for call in precompile._calls(gm):
            if choose.fast_key(call) not in seen and providers.cudnn.refusal(call) is None:
                seen.add(choose.fast_key(call))
                calls.append(call)
    start = time.monotonic()
    for call in calls:
        cudnn.candidates(call, "fast")  # each plan's graph, heuristics and support check; nothing built
    planned = time.monotonic() - start
    plans = list(cudnn._PLANS.values())
    n_engines = cudnn.ENGINES["fast"]

    def build(plan) -> float:
        t = time.monotonic()
        for index in range(min(n_engines, len(plan.engines))):
            try:
                plan.graph.build_plan_at_index(index)
            except Exception:  # noqa: BLE001  an engine config that does not build: the tuner skips it too
                pass
        return time.monotonic() - t

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        each = list(pool.map(build, plans))
    built = time.monotonic() - start
    result = {"model": args.model, "batch": args.batch, "threads": args.threads, "problems": len(calls),
              "plans": len(plans), "plan_s": round(planned, 2), "build_wall_s": round(built, 2),
              "build_summed_s": round(sum(each), 2), "gpu": torch.cuda.get_device_name()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"cudnn_build_threads_{args.threads}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
