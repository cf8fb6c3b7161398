"""Two tuning caches A/B on one model, by the GPU's time a call, interleaved (GPU machine).

  python bench/cache_ab.py [--model resnet50] [--batch 1] [--budget 500] [--against DIR] [--rounds 40] --out $OUT

"cached" compiles with the tuning cache as it is (RESFUSE_CACHE_DIR); "retuned" with a copy of it, every op
measured again (retune=True, a tuning budget of --budget s), so that candidates added since the cache was made
compete; or, with --against, "against" with the cache in DIR as it is (bench/cache_flip.py makes one).
Both run with CUDA graphs, each model its own instance, in one process. Per round each variant's GPU time
a call (resfuse.bench.timing.gpu_us: 20 calls queued behind a sleep, so the host's noisy pace is left out) and its
latency (CUDA events around each call, host included). Prints the medians, the median of the rounds' differences
and each variant's error against eager; a retuned cache goes to $OUT/retuned_cache.tgz, JSON to $OUT.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tarfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402
from resfuse.config import Config  # noqa: E402


def compiled(model_name: str, batch: int, sets: list[tuple], **config) -> tuple:
    """The model compiled by resfuse with CUDA graphs and `config`, called until its graph and handout graphs are
    captured: (the compiled model, its first call's seconds, its largest relative error against eager on `sets`).
    Each call loads a model instance of its own (bench/near_ties.py compiles many)."""
    model, _ = models.load(model_name, batch, torch.float16, "cuda")
    with torch.no_grad():
        refs = [timing.run_once(model, s) for s in sets]
    fn = resfuse.compile(model, cuda_graphs=True, **config)
    first_s, _ = timing.first_call(fn, sets[0], sets[0][0].device)
    for s in sets * 2:  # capture, and the handout graphs
        timing.run_once(fn, s)
    return fn, first_s, max(timing.output_error(timing.run_once(fn, s), r)[0] for s, r in zip(sets, refs))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--budget", type=float, default=500.0)
    p.add_argument("--against", help="a cache folder to compare as it is, instead of a retuned copy")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    cached_dir = Config.from_env().cache_dir
    if args.against:
        other, options = "against", dict(cache_dir=args.against)
    else:
        other, retuned_dir = "retuned", cached_dir.rstrip("/") + "_retuned"
        shutil.rmtree(retuned_dir, ignore_errors=True)
        shutil.copytree(cached_dir, retuned_dir)
        options = dict(cache_dir=retuned_dir, retune=True, tuning_budget_s=args.budget)
    variants = {other: options, "cached": dict(cache_dir=cached_dir)}
    _, inputs = models.load(args.model, args.batch, torch.float16, "cuda")
    sets = timing.input_sets(inputs)
    fns, errs = {}, {}
    for name, config in variants.items():  # retuned first: its tuning must not find the other's choices
        fns[name], first_s, errs[name] = compiled(args.model, args.batch, sets, **config)
        print(f"{name}: first call {first_s:.1f} s, max relative error {errs[name]:.1e}", flush=True)
    series = {name: {"gpu_us": [], "latency_us": []} for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            series[name]["gpu_us"].append(timing.gpu_us(fn, sets))
            lat = timing.latency(fn, sets, sets[0][0].device, 20, warmup=1)
            series[name]["latency_us"].append(lat.median_ms * 1e3)
    rows = {}
    for what in ("gpu_us", "latency_us"):
        a, b = series[other][what], series["cached"][what]
        rows[what] = {other: statistics.median(a), "cached": statistics.median(b),
                      "median difference": statistics.median(x - y for x, y in zip(a, b))}
        print(f"{args.model} bs{args.batch} {what}: {other} {rows[what][other]:.1f}, cached "
              f"{rows[what]['cached']:.1f} (median difference {rows[what]['median difference']:+.1f})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"cache_ab_{args.model}_bs{args.batch}.json"), "w") as f:
        json.dump({"job": f"{args.model}:{args.batch}", "rows": rows, "rel_err": errs, "series": series}, f)
    if not args.against:
        with tarfile.open(os.path.join(args.out, "retuned_cache.tgz"), "w:gz") as t:
            t.add(retuned_dir, arcname="resfuse_cache")


if __name__ == "__main__":
    main()
