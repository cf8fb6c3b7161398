"""Where a cold tuning's time goes (GPU machine), phase by phase.

Entry point: `python bench/tune_profile.py --model mobilenet_v3_large --batch 32 [--budget 600] [--cold-triton]
[--out DIR]`. Compiles the model with resfuse (CUDA graphs off, a fresh tuning cache; with --cold-triton a fresh
Triton kernel cache too) and runs it once, with the compile's and the tuner's phases wrapped in wall-clock timers:
- the graph passes, and Inductor's compile of the remainder (the rest of the first call, past tuning, is
  dynamo's capture and aot's trace);
- `precompile.ahead`, at capture: every op's kernels recorded and queued for the compile workers;
- `compile_in_parallel`, the Triton candidates built: first by `precompile` (a dry run recording each kernel,
  then waiting for the workers to compile them; timed on its own too), then loaded or compiled on a thread pool;
- `_reference`, the fp32 reference;
- `_bench`, each timed candidate (its CUDA-graph captures and replays), with the host time of the calls it makes;
- the cuDNN provider's plans: the graph and heuristics (`Plan.__init__`), each engine config's build (a `run`
  whose engine is not built yet), and the wait for the compile workers' builds of them (`cudnn_built`);
- the rest of `tune` (every candidate's first run and its check against the reference, the selection);
- every Triton compile (`triton.compiler.compile`), its wall time and its thread's CPU time summed: the CPU time
  counts the compiler's own work in its thread (the GIL's share among it), not ptxas's subprocess;
- the kernels the workers were given against those the process then compiled or loaded (a jit_cache_hook that
  declines nothing): the surplus (queued, never used) and the misses (used, never queued) by kernel, with how a
  surplus specialisation differs from a used one of the same kernel.
Prints the breakdown and writes it to DIR/tune_profile.json.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mobilenet_v3_large")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--budget", type=float, default=600.0)
    p.add_argument("--cold-triton", action="store_true",
                   help="a fresh Triton kernel cache (TRITON_CACHE_DIR) and CUDA JIT cache (CUDA_CACHE_PATH)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.cold_triton:  # and a cold CUDA driver JIT cache, where cuDNN's runtime-compiled kernels go
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cold_")
        os.environ["CUDA_CACHE_PATH"] = tempfile.mkdtemp(prefix="cuda_cold_")
    import resfuse
    from resfuse.bench import models
    from resfuse.providers import cudnn
    from resfuse.tuning import choose, precompile, workers

    spent, counts = collections.defaultdict(float), collections.Counter()

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            start = time.monotonic()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.monotonic() - start
                counts[name] += 1
        return wrapper

    choose.tune = timed("tune", choose.tune)
    choose.compile_in_parallel = timed("compile_in_parallel", choose.compile_in_parallel)
    choose._reference = timed("reference", choose._reference)
    original_precompile = precompile.precompile

    def precompiled(fns):
        n = original_precompile(fns)
        counts["kernels compiled by the workers"] += n
        return n

    precompile.precompile = timed("precompile: dry run + workers", precompiled)
    precompile.cudnn_built = timed("cudnn: wait for the workers' builds", precompile.cudnn_built)
    original_ahead = precompile.ahead

    def ahead(gm):
        n = original_ahead(gm)
        print(f"precompile.ahead: {n} kernels queued for the workers", flush=True)
        return n

    precompile.ahead = timed("precompile.ahead (dry runs, queuing)", ahead)
    from resfuse.capture import backend, inductor

    backend.run_passes = timed("graph passes", backend.run_passes)
    inductor.compile_remainder = timed("Inductor: the remainder compiled", inductor.compile_remainder)
    original_bench = choose._bench

    def bench(fn, *a, **kw):  # the host time of one call of the candidate, then the whole measurement
        start = time.monotonic()
        fn()
        torch.cuda.synchronize()
        spent["bench: one call, host + device"] += time.monotonic() - start
        return original_bench(fn, *a, **kw)

    choose._bench = timed("bench", bench)
    cudnn.Plan.__init__ = timed("cudnn graph + heuristics", cudnn.Plan.__init__)
    plan_run = cudnn.Plan.run

    def run(self, call, out, engine=None):
        index = self.engines.index(engine) if engine in self.engines else 0
        name = "cudnn engine build + first run" if index not in self.workspace_bytes else "cudnn runs"
        start = time.monotonic()
        try:
            return plan_run(self, call, out, engine)
        finally:
            spent[name] += time.monotonic() - start
            counts[name] += 1

    cudnn.Plan.run = run
    import threading

    import triton.compiler
    original_compile, compiles = triton.compiler.compile, []

    def compile_timed(*a, **kw):  # each Triton compile: its wall time and its thread's CPU time (the GIL's share)
        start, cpu = time.monotonic(), time.thread_time()
        try:
            return original_compile(*a, **kw)
        finally:
            compiles.append((time.monotonic() - start, time.thread_time() - cpu, threading.get_ident()))

    triton.compiler.compile = compile_timed
    used = {}

    def seen(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # every kernel this process builds
        jit = fn.jit_function
        used[(jit.fn.__module__, jit.fn.__name__, compile["specialization_data"])] = True
        return False

    triton.knobs.runtime.jit_cache_hook = seen  # precompile.record swaps in its own during a dry run
    model, example = models.load(args.model, args.batch, torch.float16, "cuda")
    compiled = resfuse.compile(model, cuda_graphs=False, tuning_budget_s=args.budget,
                               cache_dir=tempfile.mkdtemp(prefix="resfuse_profile_"))
    start = time.monotonic()
    with torch.no_grad():
        compiled(*example)
    torch.cuda.synchronize()
    wall = time.monotonic() - start
    spent["triton compiles, wall summed"] = sum(c[0] for c in compiles)
    spent["triton compiles, thread CPU summed"] = sum(c[1] for c in compiles)
    counts["triton compiles, wall summed"] = counts["triton compiles, thread CPU summed"] = len(compiles)
    rows = {k: {"s": round(v, 2), "calls": counts[k]} for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    queue_check = _queued_against_used({k for k in workers.QUEUED if k[0] != "cudnn"}, set(used))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_profile.json"), "w") as f:
        json.dump({"model": args.model, "batch": args.batch, "cold_triton": args.cold_triton, "first_call_s": wall,
                   "phases": rows, "queued_vs_used": queue_check}, f, indent=1)
    print(f"\n{args.model} bs{args.batch}{' (cold Triton cache)' if args.cold_triton else ''}: first call "
          f"{wall:.1f} s; ops tuned {counts['tune']}")
    for name, r in rows.items():
        print(f"  {name:34} {r['s']:8.2f} s  {r['calls']:6} calls")
    print(f"kernels queued {queue_check['queued']}, used {queue_check['used']}; surplus by kernel "
          f"{queue_check['surplus']}; missed by kernel {queue_check['missed']}")
    for name, diff in queue_check["surplus_differs_in"].items():
        print(f"  a surplus {name} differs from a used one in {diff}")


def _queued_against_used(queued: set, used: set) -> dict:
    """Which queued kernels the process never used, and which it used without queuing them, counted by kernel
    name; for each surplus kernel name, the specialisation fields where one surplus kernel differs from the used
    kernel of that name closest to it."""
    def by_name(keys):
        return dict(collections.Counter(name for _, name, _ in keys).most_common())

    def fields(key):
        return json.loads(key[2])

    surplus, differs = queued - used, {}
    for key in sorted(surplus):
        same = [fields(u) for u in used if u[:2] == key[:2]]
        if key[1] in differs or not same:
            continue
        mine = fields(key)
        diffs = [{k: (mine.get(k), other.get(k)) for k in mine.keys() | other.keys() if mine.get(k) != other.get(k)}
                 for other in same]
        differs[key[1]] = min(diffs, key=len)
    return {"queued": len(queued), "used": len(used), "surplus": by_name(surplus), "missed": by_name(used - queued),
            "surplus_differs_in": {k: {f: str(v)[:300] for f, v in d.items()} for k, d in differs.items()}}


if __name__ == "__main__":
    main()
