"""A model with and without one pass (named_activations by default), interleaved (GPU).

  python bench/activations_ab.py [--model hf-gpt2] [--batch 32] [--without named_activations | --switch NAME |
                                 --divisions] [--rounds 5] [--budget S] [--profile] --out $OUT

"before" compiles a copy of the model with the pass taken out of the pass list (GPT-2's gelu_new, eight
elementwise ops, then runs in Inductor's kernel after our GEMM; with --without glu_linears, a gated MLP's
activation and product run there after the GEMM of both halves), "after" with it (the GELU in the GEMM's
epilogue; the whole gated MLP in one GEMM). Both are resfuse+graphs, compiled once each and alive side by side (a
deep copy each, so Dynamo keeps both), then timed in alternation, `rounds` times: the GPU's time a call
(run._gpu_ms: 20 calls queued, or 4 or 1 where the queue cannot hold 20, as GPT-2's graph breaks make it), the
CUDA-event latency and the SM clock. Both compile with fuse_glu on (off by default). With --switch, a Config
switch is what differs instead (off before, on after), every pass running. With --divisions, the activations' Triton
code is what differs (every pass running, fuse_glu on): "before" compiles and captures its graphs with the op
table's forms of the forty-eighth session (silu, sigmoid, tanh-GELU, hardswish and hardsigmoid through IEEE
divisions in every dtype: the tuning cache's choices for them), then the in-process kernel and plan caches are
emptied, so "after" generates the current forms (no division for fp16/bf16 outputs) and tunes them; each keeps its
captured kernels. Errors against eager. With --profile, each variant's kernels (timing.kernels). Prints a table;
JSON to $OUT.
"""
import argparse
import copy
import json
import os
import statistics
import sys
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse import epilogue as epi, passes  # noqa: E402
from resfuse.kernels import chain, codegen, plan, shortcut  # noqa: E402
from resfuse.tuning import choose  # noqa: E402
from resfuse.bench import models, run, timing  # noqa: E402


def _divided_ops() -> dict:
    """The op table's entries that the forty-ninth session changed, as they were: IEEE divisions in every dtype,
    version 0 (so the tuning cache's keys of that time)."""
    clamp = epi._clamp_tl
    u = "(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))"
    return {
        "gelu_tanh": epi.OpSpec(1, lambda x: F.gelu(x, approximate="tanh"), lambda x: (
            f"(0.5 * {x} * (1.0 + {epi._tanh_tl(u.format(x=x))}))")),
        "silu": epi.OpSpec(1, F.silu, lambda x: f"({x} / (1.0 + tl.exp(-{x})))"),
        "sigmoid": epi.OpSpec(1, torch.sigmoid, lambda x: f"(1.0 / (1.0 + tl.exp(-{x})))"),
        "hardswish": epi.OpSpec(1, F.hardswish, lambda x: f"({x} * {clamp(f'({x} + 3.0)', 0.0, 6.0)} / 6.0)"),
        "hardsigmoid": epi.OpSpec(1, F.hardsigmoid, lambda x: f"({clamp(f'({x} + 3.0)', 0.0, 6.0)} / 6.0)")}


def _forget_kernels() -> None:
    """Empty the in-process caches of generated kernels, launch plans and tuned choices (keyed without the ops'
    versions), so the next compile looks its choices up under its own keys and generates its kernels again."""
    for cache in (codegen._LOADED, plan._PLANS, chain._PLANS, shortcut._PLANS, choose._CHOICES):
        cache.clear()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="hf-gpt2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--without", default="named_activations", help="the pass that 'before' runs without")
    p.add_argument("--switch", help="instead: a resfuse.Config switch, off in 'before' and on in 'after'")
    p.add_argument("--divisions", action="store_true", help="instead: the activations' forms with IEEE divisions "
                   "in 'before'")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, help="each compile's tuning budget in seconds (Config.tuning_budget_s)")
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
        if args.budget is not None:
            options["tuning_budget_s"] = args.budget
        fn = resfuse.compile(copy.deepcopy(model), cuda_graphs=True, **options)
        cut = without if variant == "before" and not (args.switch or args.divisions) else passes.PASSES
        ops = _divided_ops() if variant == "before" and args.divisions else {}
        with mock.patch.object(passes, "PASSES", cut), mock.patch.dict(epi.OPS, ops), \
                torch.no_grad():
            out = fn(*inputs).float()
            for s in sets:
                fn(*s)
        fns[variant] = fn
        if args.divisions:
            _forget_kernels()
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
    what = args.switch or ("divisions" if args.divisions else args.without)
    name = os.path.basename(args.model).replace(".py:", "_")  # a file.py:factory names a file, not a folder
    with open(os.path.join(args.out, f"pass_ab_{name}_bs{args.batch}_{what}.json"), "w") as f:
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
