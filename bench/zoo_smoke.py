"""Every zoo model compiled once with heuristic configs (no tuning) against eager, in fp16 and under autocast (GPU
machine): a quick check that each still compiles, matches eager, and what the report says (hoisted values, notes,
errors), after a change to the capture or the passes. Not a timing.

  python bench/zoo_smoke.py [--models resnet50,hf-bert-base] [--batch 2] [--out $OUT]

Each model runs at a small batch, fp16 weights, then fp32 weights under torch.autocast (fp16), with resfuse's
default options (CUDA graphs for inference) but tuning="none". Prints a table last; zoo_smoke.json has the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402


def check(name: str, batch: int, autocast: bool, device: str) -> dict:
    half = torch.float16 if device == "cuda" else torch.bfloat16
    model, inputs = models.load(name, batch, torch.float32 if autocast else half, device, image_size=224, seq=128)
    if autocast:
        model = models.Autocast(model, half, device)
    refs = timing.run_once(model, inputs)
    torch._dynamo.reset()
    compiled = resfuse.compile(model, tuning="none")
    t0 = time.perf_counter()
    outs = [timing.run_once(compiled, inputs) for _ in range(3)][-1]  # the third call replays a CUDA graph
    rel, _ = timing.output_error(outs, refs)
    report = compiled.resfuse_report
    return {"model": name, "autocast": autocast, "rel_err": rel, "s": time.perf_counter() - t0,
            "fusions": len(report.fusions), "hoisted": [r for r in report.rewrites if "hoisted" in r],
            "notes": list(report.notes), "errors": list(report.errors)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default=",".join(models.names()))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cpu (bf16) only to smoke-test this script")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    rows = []
    for name in args.models.split(","):
        for autocast in (False, True):
            try:
                rows.append(check(name, args.batch, autocast, args.device))
            except Exception as e:  # one model failing must not hide the others
                traceback.print_exc()
                rows.append({"model": name, "autocast": autocast, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(json.dumps(rows[-1]), flush=True)
            Path(args.out).mkdir(parents=True, exist_ok=True)  # after every row: a run cut off keeps what it did
            Path(args.out, "zoo_smoke.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'model':22s} {'autocast':8s} {'rel err':>9s} {'fusions':>7s} {'s':>6s}  hoisted / notes / errors")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:22s} {str(r['autocast']):8s} FAILED {r['error'][:120]}")
            continue
        said = "; ".join(x[:90] for x in [*r["hoisted"], *r["notes"], *r["errors"]]) or "-"
        print(f"{r['model']:22s} {str(r['autocast']):8s} {r['rel_err']:9.1e} {r['fusions']:7d} {r['s']:6.1f}  {said}")


if __name__ == "__main__":
    main()
