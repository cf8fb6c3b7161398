"""A model's near-tie tuning choices, each flipped alone and timed in the model (GPU machine).

  python bench/near_ties.py [--model resnet50] [--batch 1] [--within 0.1] [--max 16] [--rounds 10] --out $OUT

The tuner ranks candidates by timing each op alone; in the model the ranking of near-ties can turn (BENCHMARKS.md,
forty-fifth session: flipping ResNet-50 bs1's cuDNN winners within 6% to ours cost 22.9 us of GPU time a call where
the tuner's timings said 1.5). Here the model is compiled with the tuning cache (RESFUSE_CACHE_DIR), the entries its
ops read are recorded, and each of them whose other provider's best candidate is within --within of the winner
(bench/cache_flip.py's near_ties; at most --max, closest first) gets a copy of the cache with that entry alone
flipped and a compile of the model with it. Every variant's GPU time a call (timing.gpu_us, the host left out) is
then taken in turn, --rounds rounds, beside the unflipped model and a second unflipped compile (the noise). Last,
the flips that gained more than twice the noise, together, against the unflipped model. Prints each flip's
difference per call of the op as the tuner timed it and the model's measured difference; JSON and the combined
cache (near_ties_cache.tgz, for .devcache/ where it gains) to $OUT.
"""
import argparse
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tarfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import cache_ab  # noqa: E402
import cache_flip  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402
from resfuse.config import Config  # noqa: E402
from resfuse.tuning import cache  # noqa: E402

READ = set()  # digests of the entries looked up while recording
_lookup = cache.TuningCache.lookup


def _recording_lookup(self, key, machine):
    READ.add(key.digest())
    return _lookup(self, key, machine)


def compiled(args, cache_dir: str, sets: list[tuple]):
    """The model compiled on cache_dir (bench/cache_ab.py's compile): (fn, its largest relative error)."""
    fn, _, err = cache_ab.compiled(args.model, args.batch, sets, cache_dir=cache_dir)
    return fn, err


def variant_cache(base: str, path: str, flips: list[tuple]) -> str:
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(base, path)
    db = sqlite3.connect(os.path.join(path, "tuning.sqlite"))
    for digest, label in flips:
        cache_flip.flip(db, digest, label)
    db.commit()
    db.close()
    return path


def timed(fns: dict, sets: list[tuple], rounds: int) -> dict:
    """name -> its GPU us a call, over rounds taken in turn."""
    series = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            series[name].append(timing.gpu_us(fn, sets))
    return series


def difference(series: dict, name: str, base: str = "unflipped") -> float:
    return statistics.median(a - b for a, b in zip(series[name], series[base]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--within", type=float, default=0.1)
    p.add_argument("--max", type=int, default=16)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    # every variant is a compile of the same forward: past Dynamo's limit of 8 it would run eager, so fail instead
    torch._dynamo.config.recompile_limit = 2 * args.max + 8
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    base = Config.from_env().cache_dir
    _, inputs = models.load(args.model, args.batch, torch.float16, "cuda")
    sets = timing.input_sets(inputs)
    cache.TuningCache.lookup = _recording_lookup
    fns, errs = {}, {}
    fns["unflipped"], errs["unflipped"] = compiled(args, base, sets)
    cache.TuningCache.lookup = _lookup
    gpu = torch.cuda.get_device_name()
    db = sqlite3.connect(os.path.join(base, "tuning.sqlite"))
    ties = [t for t in cache_flip.near_ties(db, args.batch, gpu, args.within) if t[0] in READ]
    ties = sorted(ties, key=lambda t: t[5] / t[3])[:args.max]
    print(f"{len(READ)} entries read, {len(ties)} near-ties within {args.within:.0%}", flush=True)
    fns["unflipped again"], errs["unflipped again"] = compiled(args, variant_cache(base, base + "_nt", []), sets)
    rows = {}
    for i, (digest, k, won_by, won, label, t) in enumerate(ties):
        name = f"{k['op']} {k['shape'][:2]} {k['epilogue']}: {won_by} -> {label.split(':')[0]}"
        fns[name], errs[name] = compiled(args, variant_cache(base, f"{base}_nt{i}", [(digest, label)]), sets)
        rows[name] = {"digest": digest, "label": label, "tuner_us": (t - won) * 1e6}
        print(f"compiled {name} (error {errs[name]:.1e})", flush=True)
    series = timed(fns, sets, args.rounds)
    noise = abs(difference(series, "unflipped again"))
    for name, row in rows.items():
        row["model_us"] = difference(series, name)
    gains = [row for row in rows.values() if row["model_us"] < -2 * noise]
    combined = variant_cache(base, base + "_ntall", [(r["digest"], r["label"]) for r in gains])
    if gains:
        fns = {"unflipped": fns["unflipped"]}
        fns["combined"], errs["combined"] = compiled(args, combined, sets)
        together = timed(fns, sets, args.rounds)
        combined_us = difference(together, "combined")
    else:
        combined_us = None
    print(f"\n{args.model} bs{args.batch}: unflipped {statistics.median(series['unflipped']):.1f} us of GPU a call, "
          f"noise {noise:.2f} us (a second unflipped compile)")
    print(f"{'tuner us':>9} {'model us':>9}  flip (one op)")
    for name, row in sorted(rows.items(), key=lambda item: item[1]["model_us"]):
        print(f"{row['tuner_us']:>+9.2f} {row['model_us']:>+9.2f}  {name[:150]}")
    if combined_us is not None:
        print(f"the {len(gains)} flips that gained, together: {combined_us:+.2f} us a call")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"near_ties_{args.model}_bs{args.batch}.json"), "w") as f:
        json.dump({"job": f"{args.model}:{args.batch}", "noise_us": noise, "flips": rows, "combined_us": combined_us,
                   "rel_err": errs, "series": series}, f)
    with tarfile.open(os.path.join(args.out, "near_ties_cache.tgz"), "w:gz") as t:
        t.add(combined, arcname="resfuse_cache")


if __name__ == "__main__":
    main()
