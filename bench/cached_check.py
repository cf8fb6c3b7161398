"""What checking the cached choices costs a warm start (GPU machine).

Entry point: `python bench/cached_check.py [--model resnet50] [--batch 32]`. The thirty-ninth session made the tuner
check each cached choice, as it checks a candidate, before its first use (tuning/choose.py: cached_is_wrong); since
the fortieth, once a machine (GPU and driver), not once a process. This script tunes the model in a first process
(cold, unless the cache already holds it), then in fresh processes compiles it again from the warm cache and times
the first call: its wall time, and the part spent in the checks, with their count and how many found a choice
wrong. Before the third process it forgets the checks (as a cache carried to another machine has none), so that
process checks every choice, and the fourth none.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse  # noqa: E402
from resfuse.bench import models  # noqa: E402
from resfuse.config import Config  # noqa: E402
from resfuse.tuning import choose  # noqa: E402
from resfuse.tuning.cache import TuningCache  # noqa: E402


def first_call(name: str, batch: int) -> dict:
    spent, wrong = [], []
    check = choose.cached_is_wrong

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        why = check(*args, **kwargs)
        spent.append(time.perf_counter() - t0)
        wrong.extend([why] if why else [])
        return why
    choose.cached_is_wrong = timed
    model, inputs = models.load(name, batch, torch.float16, torch.device("cuda"), image_size=224, seq=384)
    fn = resfuse.compile(model)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(*inputs)
    torch.cuda.synchronize()
    return {"first_call_s": time.perf_counter() - t0, "checks": len(spent), "checks_s": sum(spent),
            "slowest_check_s": max(spent, default=0.0), "wrong": wrong}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(first_call(args.model, args.batch)))
        return 0
    argv = [sys.executable, __file__, "--child", "--model", args.model, "--batch", str(args.batch)]
    for label in ("first process (tunes what the cache lacks)", "warm process", "warm process, checks forgotten",
                  "warm process again"):
        if "forgotten" in label:
            TuningCache(Path(Config.from_env().cache_dir) / "tuning.sqlite").forget_checks()
        out = subprocess.run(argv, capture_output=True, text=True)
        lines = out.stdout.strip().splitlines()
        print(f"{args.model} bs{args.batch} {label}: {lines[-1] if lines else out.stderr[-2000:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
