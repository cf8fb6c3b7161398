"""Where a warm start's time goes (issue 4: a warm cache should reach the first output in <= 2 s).

  python3 bench/warm_start.py --model resnet50 --batch 256 --out $OUT

One process tunes with a fresh cache (cold). Then, each in a fresh process: resfuse's warm start under
cProfile (top functions by cumulative and own time, written to $OUT), resfuse's warm start with phase timings,
and torch.compile default's warm start (its own FX graph cache warm from a first process) as the peer; and
the capture alone (resfuse.explain: dynamo, aot_autograd and our passes, no kernel), the part torch sets.
Where the Python image writes no bytecode (PYTHONDONTWRITEBYTECODE), every process compiles torch's sources
again: unset it and set PYTHONPYCACHEPREFIX to a writable folder to time what a user's machine would see.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse.bench import models  # noqa: E402


def first_output(args, cache_dir: str) -> dict:
    """Seconds from model in hand to first output, with the time of each phase."""
    t0 = time.perf_counter()
    model, (x,) = models.load(args.model, args.batch, torch.float16, "cuda")
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    if args.peer == "compile":
        compiled = torch.compile(model)
    elif args.peer == "capture":  # dynamo + aot_autograd + our passes, then the captured graph in eager ops
        compiled = lambda x: resfuse.explain(model, x, cache_dir=cache_dir)  # noqa: E731
    else:
        compiled = resfuse.compile(model, cache_dir=cache_dir, cuda_graphs=args.graphs, tuning_budget_s=60.0)
    with torch.no_grad():
        compiled(x)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    with torch.no_grad():
        compiled(x)
    torch.cuda.synchronize()
    out = {"load_s": t1 - t0, "first_output_s": t2 - t1, "second_call_s": time.perf_counter() - t2}
    if args.peer == "resfuse":
        from resfuse.tuning import choose

        out.update(tuned_s=choose._STATE["spent_s"], choices=len(choose._CHOICES))
    return out


def child(args, cache_dir: str) -> None:
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        result = first_output(args, cache_dir)
        prof.disable()
        for order in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(60)
            with open(os.path.join(args.out, f"warm_profile_{args.peer}_{order}.txt"), "w") as f:
                f.write(s.getvalue())
    else:
        result = first_output(args, cache_dir)
    print(json.dumps(result))


def spawn(args, cache_dir: str, *extra) -> dict:
    cmd = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch), "--out", args.out,
           "--child", cache_dir, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--cache", help="an already tuned cache folder (skips the cold run)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--peer", default="resfuse", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--graphs", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args, args.child)
    cache_dir = args.cache or tempfile.mkdtemp(prefix="resfuse-warm-")
    rows = {}
    if not args.cache:
        rows["resfuse cold"] = spawn(args, cache_dir)
    rows["resfuse warm (profiled)"] = spawn(args, cache_dir, "--profile")
    rows["resfuse warm"] = spawn(args, cache_dir)
    rows["resfuse+graphs warm"] = spawn(args, cache_dir, "--graphs")
    rows["capture alone (explain)"] = spawn(args, cache_dir, "--peer", "capture")
    rows["compile first"] = spawn(args, cache_dir, "--peer", "compile")
    rows["compile warm"] = spawn(args, cache_dir, "--peer", "compile")
    with open(os.path.join(args.out, f"warm_start_{args.model}_bs{args.batch}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{args.model} bs{args.batch} fp16 on {torch.cuda.get_device_name()}; seconds")
    for name, r in rows.items():
        print(f"{name:26s} " + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in r.items() if k != "error") + (" ERROR" if "error" in r else ""))
        if "error" in r:
            print(r["error"])


if __name__ == "__main__":
    main()
