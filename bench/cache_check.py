"""Does a second process hit the tuning cache the first one filled? (GPU machine; a debugging aid.)

  python3 bench/cache_check.py --model resnet18 --batch 4
Runs itself twice as children on one fresh cache dir; the second child reports how long it tuned, and for
each key it computed that the cache lacks, the fields that differ from the cached key of the same op/shape.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def child(model_name, batch, cache_dir):
    import dataclasses

    import resfuse
    from resfuse.bench import models
    from resfuse.tuning import choose as ch

    seen = []
    real_key = ch.key
    ch.key = lambda call: seen.append(real_key(call)) or seen[-1]
    model, (x,) = models.load(model_name, batch, torch.float16, "cuda")
    with torch.no_grad():
        resfuse.compile(model, cache_dir=cache_dir)(x)
    cached = [k for k, _ in ch._cache().entries()]
    misses = []
    for k in seen:
        if ch._cache().get(k) is None:
            misses.append("no entry")
            continue
    diffs = []
    for k in seen[:3]:
        d = json.loads(json.dumps(dataclasses.asdict(k)))
        same = [c for c in cached if c["op"] == d["op"] and c["shape"] == d["shape"]]
        for c in same[:1]:
            diffs.append({f: (c[f], d[f]) for f in d if c[f] != d[f]})
    print(json.dumps({"tuned_s": ch._STATE["spent_s"], "keys": len(seen), "cached": len(cached), "diffs": diffs}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--child", metavar="CACHE")
    args = p.parse_args()
    if args.child:
        return child(args.model, args.batch, args.child)
    cache = tempfile.mkdtemp()
    for run in (1, 2):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--batch", str(args.batch),
                              "--child", cache], capture_output=True, text=True)
        print(f"run {run}:", out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-3000:])


if __name__ == "__main__":
    main()
