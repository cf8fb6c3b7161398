"""Cold tuning, warm start, per-op provider wins, and latency with tuned choices (GPU machine).

  python3 bench/tune.py --model resnet50 --batch 32 256 --out $OUT

For each batch, in one process: eager and torch.compile reduce-overhead timings; then resfuse with a fresh
tuning cache (cold: capture + kernel builds + tuning until the first output), its latency with and without
CUDA graphs, and numerics against eager. A child process then measures the warm start (same cache: time to
first output). Prints which provider won each tuned op and by how much over aten, then a short table.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402


def median_ms(fn, x, iters=50):
    """Median CUDA-event latency of fn(x) over one input set (the harness's timer)."""
    return timing.latency(fn, [(x,)], x.device, iters, warmup=5).median_ms


def first_output_s(model_name, batch, cache_dir, graphs, budget_s=60.0):
    model, (x,) = models.load(model_name, batch, torch.float16, "cuda")
    start = time.perf_counter()
    compiled = resfuse.compile(model, cache_dir=cache_dir, cuda_graphs=graphs, tuning_budget_s=budget_s)
    with torch.no_grad():
        compiled(x)
    torch.cuda.synchronize()
    return time.perf_counter() - start, model, x, compiled


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--budget", type=float, default=60.0, help="tuning_budget_s of the cold run")
    p.add_argument("--warm-child", nargs=2, metavar=("BATCH", "CACHE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    if args.warm_child:
        t, *_ = first_output_s(args.model, int(args.warm_child[0]), args.warm_child[1], False)
        from resfuse.tuning import choose

        print(json.dumps({"warm_s": t, "tuned_s": choose._STATE["spent_s"], "choices": len(choose._CHOICES)}))
        return
    rows, log = [], []
    for batch in args.batch:
        cache_dir = tempfile.mkdtemp(prefix="resfuse-tune-")
        cold, model, x, compiled = first_output_s(args.model, batch, cache_dir, False, args.budget)
        with torch.no_grad():
            ref = model(x).float()
            err = ((compiled(x).float() - ref).norm() / ref.norm()).item()
            graphed = resfuse.compile(model, cache_dir=cache_dir, cuda_graphs=True)
            ro = torch.compile(model, mode="reduce-overhead")
            t = {"eager": median_ms(model, x), "reduce-overhead": median_ms(ro, x),
                 "resfuse": median_ms(compiled, x), "resfuse+graphs": median_ms(graphed, x)}
        child = json.loads(subprocess.run([sys.executable, __file__, "--model", args.model, "--warm-child",
                                           str(batch), cache_dir], capture_output=True, text=True,
                                          check=True).stdout.strip().splitlines()[-1])
        warm = child["warm_s"]
        log.append(f"bs{batch} warm start: {child}")
        from resfuse.tuning.cache import TuningCache

        entries = TuningCache(os.path.join(cache_dir, "tuning.sqlite")).entries()
        wins = {}
        for key, entry in entries:
            best = min(entry.times.values())
            aten = entry.times.get("aten")
            wins.setdefault(entry.provider, []).append(aten / best if aten else float("nan"))
            log.append(f"bs{batch} {key['op']} {key['shape']} {key['epilogue']}: {entry.provider} "
                       f"{best * 1e6:.1f} us, x{(aten or float('nan')) / best:.2f} over aten")
        rows.append((batch, cold, warm, t, err, {k: (len(v), sum(v) / len(v)) for k, v in wins.items()}))
    with open(os.path.join(args.out, "tune.log"), "w") as f:
        f.write("\n".join(log))
    print("\n".join(log[-40:]))
    print(f"\n{args.model} fp16 channels_last on {torch.cuda.get_device_name()}; median ms; tuning level fast")
    for batch, cold, warm, t, err, wins in rows:
        print(f"bs{batch}: cold first output {cold:.1f} s, warm {warm:.1f} s, rel err {err:.1e}; "
              + "  ".join(f"{k} {v:.3f}" for k, v in t.items())
              + "; wins " + ", ".join(f"{k}: {n} ops (mean x{m:.2f} over aten)" for k, (n, m) in wins.items()))


if __name__ == "__main__":
    main()
