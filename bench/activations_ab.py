"""A model with and without one pass (named_activations by default), interleaved (GPU).

  python bench/activations_ab.py [--model hf-gpt2] [--batch 32] [--without named_activations | --switch NAME]
                                 [--rounds 5] [--profile] --out $OUT

"before" compiles a copy of the model with the pass taken out of the pass list (GPT-2's gelu_new, eight
elementwise ops, then runs in Inductor's kernel after our GEMM; with --without glu_linears, a gated MLP's
activation and product run there after the GEMM of both halves), "after" with it (the GELU in the GEMM's
epilogue; the whole gated MLP in one GEMM). Both are resfuse+graphs, compiled once each and alive side by side (a
deep copy each, so Dynamo keeps both), then timed in alternation, `rounds` times: the GPU's time a call
(run._gpu_ms: 20 calls queued, or 4 or 1 where the queue cannot hold 20, as GPT-2's graph breaks make it), the
CUDA-event latency and the SM clock. Both compile with fuse_glu on (off by default). With --switch, a Config
switch is what differs instead (off before, on after), every pass running. Errors against eager. With
--profile, each variant's kernels (timing.kernels). Prints a table; JSON to $OUT.
"""
import argparse
import copy
import json
import os
import statistics
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse import passes  # noqa: E402
from resfuse.bench import models, run, timing  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="hf-gpt2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--without", default="named_activations", help="the pass that 'before' runs without")
    p.add_argument("--switch", help="instead: a resfuse.Config switch, off in 'before' and on in 'after'")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="also print each variant's top kernels (torch.profiler)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    model, inputs = models.load(args.model, args.batch, torch.float16, "cuda")
    sets = timing.input_sets(inputs)
    with torch.no_grad():
        ref = model(*inputs).float()
    without = [step for step in passes.PASSES if step[0] != args.without]
    assert len(without) == len(passes.PASSES) - 1, f"no pass named {args.without}"
    fns, res = {}, {}
    for variant in ("before", "after"):
        options = {args.switch: variant == "after"} if args.switch else {"fuse_glu": True}  # else the pass differs
        fn = resfuse.compile(copy.deepcopy(model), cuda_graphs=True, **options)
        cut = without if variant == "before" and not args.switch else passes.PASSES
        with mock.patch.object(passes, "PASSES", cut), \
                torch.no_grad():
            out = fn(*inputs).float()
            for s in sets:
                fn(*s)
        fns[variant] = fn
        report = fn.resfuse_report
        res[variant] = {"rel_err": ((out - ref).norm() / ref.norm()).item(), "gpu_us": [], "latency_ms": [],
                        "fusions": sorted({"+".join(f.ops) for f in report.fusions}), "rewrites": report.rewrites}
    for _ in range(args.rounds):
        for variant, fn in fns.items():
            res[variant]["gpu_us"].append(run._gpu_ms(fn, sets, repeats=1) * 1e3)  # 20 calls queued, or 4, or 1
            lat = timing.latency(fn, sets, torch.device("cuda"), 50)
            res[variant]["latency_ms"].append(lat.median_ms)
            res[variant].setdefault("clock", []).append(lat.clock)  # the SM clock while timed (power cap)
    if args.profile:
        for variant, fn in fns.items():
            res[variant]["kernels"] = timing.kernels(fn, sets, torch.device("cuda"))
    what = args.switch or args.without
    with open(os.path.join(args.out, f"pass_ab_{args.model}_bs{args.batch}_{what}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{args.model} bs{args.batch} without/with {what}: median of {args.rounds} rounds")
    for variant, r in res.items():
        print(f"{variant:<7} clocks {[c and (c['sm_mhz'], round(c['limited'], 2)) for c in r['clock']]}")
        print(f"{variant:<7} GPU us {statistics.median(r['gpu_us']):9.1f}  latency ms "
              f"{statistics.median(r['latency_ms']):7.3f}  rel err {r['rel_err']:.1e}  fusions {r['fusions']}")
    for variant, r in res.items():
        for k in r.get("kernels", [])[:14]:
            print(f"  {variant:<7} {k['name'][:70]:<70} {k['time_us']:9.1f} us {k['calls']:4d} calls")
    diff = statistics.median(b - a for a, b in zip(res["before"]["gpu_us"], res["after"]["gpu_us"]))
    print(f"after - before, GPU us a call (median of the rounds' differences): {diff:+.1f}")


if __name__ == "__main__":
    main()
