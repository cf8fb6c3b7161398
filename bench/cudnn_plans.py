"""Every cuDNN engine config of the cudnn provider's graphs against the heuristic's first (GPU machine, frontend).

Entry point: `python bench/cudnn_plans.py [--batch 256,32] [--gemms 32] [--max-plans 16] [--out DIR]`.
For ResNet-50's layers (fp16, channels_last, the batch norm folded as the provider folds it) and BERT-base's
GEMMs at sequence 384, it makes the provider's graph with its ranked engine configs (heuristics A, then the
fallback list), builds and times each one (CUDA-graph replay), checks each against the fp32 unfused reference,
and prints per problem: the count, the first one's time (what the provider ran before it timed engines), the
fastest and its name, and the build time of all. The question it answered: does timing cuDNN's engine
configs beat its heuristic's first? (Yes: bench/results/cudnn_plans_*_h100.*.)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cudnn_check import LAYERS, make_call  # noqa: E402
from resfuse.ops.fused import Output  # noqa: E402
from resfuse.providers import cudnn, fold_bn  # noqa: E402
from resfuse.tuning import choose  # noqa: E402

GEMMS = [  # name, M per sequence, K, N, signature (BERT-base, per batch of 384-token sequences)
    ("bert qkv + bias", 768, 2304, "add(acc,c0)"),
    ("bert out + bias + res", 768, 768, "add(add(acc,c0),full1)"),
    ("bert ffn1 + bias + gelu", 768, 3072, "gelu(add(acc,c0))"),
    ("bert ffn2 + bias + res", 3072, 768, "add(add(acc,c0),full1)"),
]


def gemm_call(tokens, k, n, sig):
    dev, dt = "cuda", torch.float16
    a = torch.randn(tokens, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
    ops = [torch.randn(n, device=dev, dtype=dt)] + ([torch.randn(tokens, n, device=dev, dtype=dt)] if "full" in sig
                                                     else [])
    return choose.Call("gemm", (a, w.t()), ops, sig, ([tokens, n],), Output.of([tokens, n], dt, a.device))


def time_plans(call, max_plans):
    """Each plan's build time, device time and error against the fp32 reference of `call` (the unfolded call: a
    folded call's old batch-norm operands stay in its list unread, which the reference's operand views do not
    expect). A conv runs with its batch norm folded, as the provider runs it for inference."""
    ref = choose._reference(call).double()
    call = fold_bn.folded_call(call) if call.op == "conv2d" else call
    plan, rows = cudnn.Plan(call), []
    out = call.out.empty()
    for i, name in enumerate(plan.engines[:max_plans]):
        start = time.monotonic()
        try:
            out.fill_(float("nan"))
            plan.run(call, out, name)  # builds it
            torch.cuda.synchronize()
            build_s = time.monotonic() - start
            err = ((out.double() - ref).norm() / ref.norm()).item()
            us = choose._bench(lambda name=name: plan.run(call, out, name)) * 1e6
        except Exception as e:  # noqa: BLE001
            rows.append({"index": i, "name": name, "error": f"{type(e).__name__}: {str(e)[:100]}"})
            continue
        rows.append({"index": i, "name": name, "build_s": round(build_s, 3), "us": round(us, 2), "err": err,
                     "workspace": plan.built[name][1]})
    return len(plan.engines), rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", default="256,32")
    p.add_argument("--max-plans", type=int, default=16)
    p.add_argument("--gemms", default="32", help="BERT batch sizes (sequences of 384), '' for none")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    problems = []
    for batch in map(int, args.batch.split(",")):
        for name, *shape, sig in LAYERS:
            problems.append((f"bs{batch} {name}", lambda b=batch, shape=shape, sig=sig: make_call(b, *shape, sig)))
    for batch in [int(b) for b in args.gemms.split(",") if b]:
        for name, k, n, sig in GEMMS:
            problems.append((f"bs{batch} {name}", lambda b=batch, k=k, n=n, sig=sig: gemm_call(384 * b, k, n, sig)))
    log, summary = [], []
    for name, make in problems:
        call = make()
        start = time.monotonic()
        try:
            count, rows = time_plans(call, args.max_plans)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        good = [r for r in rows if "us" in r and r["err"] < 5e-3]
        first = next((r for r in rows if "us" in r), None)
        best = min(good, key=lambda r: r["us"]) if good else None
        line = {"problem": name, "plans": count, "timed": len(rows), "first_us": first and first["us"],
                "first": first and first["name"], "best_us": best and best["us"], "best": best and best["name"],
                "best_index": best and best["index"], "total_s": round(time.monotonic() - start, 1),
                "build_s": round(sum(r.get("build_s", 0) for r in rows), 1)}
        print(json.dumps(line), flush=True)
        log.append({**line, "rows": rows})
        summary.append(line)
        Path(args.out, "cudnn_plans.json").write_text(json.dumps(log, indent=1))
    print(f"\n{'problem':34s} {'plans':>5s} {'first us':>9s} {'best us':>9s} {'gain':>6s} {'build s':>7s}  best")
    for s in summary:
        gain = s["first_us"] / s["best_us"] if s["first_us"] and s["best_us"] else float("nan")
        print(f"{s['problem']:34s} {s['plans']:5d} {s['first_us'] or 0:9.1f} {s['best_us'] or 0:9.1f} {gain:6.2f} "
              f"{s['build_s']:7.1f}  {s['best_index']} {s['best']}")


if __name__ == "__main__":
    main()
