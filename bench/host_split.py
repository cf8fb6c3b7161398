"""Where an un-graphed resfuse call spends its host time, layer by layer of our Python (GPU machine).

  python bench/host_split.py [--jobs resnet50:32,hf-bert-base:32,resnet50:16:train] [--calls 50] --out $OUT

cProfile (bench/host_profile.py) inflates every small Python call several times over. Here each layer of the
path is wrapped in a perf_counter timer instead: the custom op as Inductor's code calls it (dispatcher
included), our implementation under it, the tuner's lookup, the call description, the providers, Triton's
launcher and the cuDNN frontend's execute. Times are inclusive (a layer contains the ones under it), in us of
host time per model call, with the GPU never the bottleneck (launches are asynchronous and the GPU's time per
call is a tenth of the host's). Also times eager, and one aten add on a tiny tensor as this host's yardstick.
Each job is timed with plan.Launcher's direct launches off and on, in alternation (the host's speed drifts), first
without the timers; a job NAME:BATCH:train times a training step (forward, backward, SGD) at tuning="none".
"""
import argparse
import collections
import contextlib
import copy
import functools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse.bench import models  # noqa: E402

TIMES = collections.defaultdict(float)
COUNTS = collections.Counter()


def timed(label, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - t0
            COUNTS[label] += 1
    return run


def patch(obj, name, label):
    setattr(obj, name, timed(label, getattr(obj, name)))


def instrument():
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor
    from resfuse import kernels
    from resfuse.kernels import launch, plan
    from resfuse.ops import chain, fused, shortcut
    from resfuse.providers import cudnn, epilogue
    from resfuse.tuning import choose

    for op in ("conv2d", "gemm", "conv2d_chain", "conv2d_shortcut", "image_conv", "max_pool2d_epilogue",
               "pad_channels", "conv2d_aux", "gemm_aux"):
        packet = getattr(torch.ops.resfuse, op)
        packet.default = timed(f"op {op} (dispatcher + impl)", packet.default)
    patch(fused, "_conv2d", "  impl: fused._conv2d")
    patch(fused, "_gemm", "  impl: fused._gemm")
    patch(chain, "run_pair", "  impl: chain.run_pair")
    patch(shortcut, "run_kernel", "  impl: shortcut.run_kernel")
    patch(fused, "call_of", "    fused.call_of")
    patch(choose, "choose", "    choose.choose")
    patch(cudnn, "run", "    cudnn.run")
    patch(cudnn, "folded_call", "      cudnn: fold_bn.folded_call")
    patch(cudnn, "_plan", "      cudnn._plan (fast_key)")
    patch(cudnn.Plan, "run", "      cudnn.Plan.run")
    patch(epilogue, "run", "    epilogue.run (ATen + epilogue kernel)")
    for name in ("conv2d", "gemm", "epilogue", "conv2d_shortcut", "conv2d_chain"):
        if hasattr(kernels, name):
            patch(kernels, name, f"    kernels.{name}")
    patch(launch, "conv_as_gemm", "      launch.conv_as_gemm")
    patch(launch, "plan_key", "      launch.plan_key")
    patch(plan.Plan, "launch", "      plan.Plan.launch")
    patch(plan.Launcher, "__call__", "        plan.Launcher")
    patch(TensorDescriptor, "from_tensor", "        TensorDescriptor.from_tensor")
    patch(triton.runtime.jit.JITFunction, "run", "        triton JITFunction.run")
    from cudnn import _pygraph
    patch(_pygraph.pygraph, "_execute", "        cudnn frontend pygraph._execute")


def set_mode(direct: bool) -> None:
    """plan.Launcher's direct launches on or off, in every plan made so far and every one made from now on."""
    from resfuse.kernels import chain, plan, shortcut

    if not hasattr(plan.Launcher, "_direct_on"):
        plan.Launcher._direct_on = plan.Launcher._direct
    plan.Launcher._direct = plan.Launcher._direct_on if direct else (lambda self, compiled, given: False)
    for table in (plan._PLANS, chain._PLANS, shortcut._PLANS):
        for p in table.values():
            launcher = getattr(p, "kernel", None) if isinstance(p, plan.Plan) else getattr(p, "launcher", None)
            if launcher is not None:
                launcher.direct = None
    for launcher in plan._LAUNCHERS.values():
        launcher.direct = None


def host_us(fn, x, calls):
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    TIMES.clear()
    COUNTS.clear()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    return wall / calls * 1e6


def train_step(fn, opt, x) -> None:
    loss = fn(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def rel_err(out, ref) -> float:
    out, ref = out.last_hidden_state if hasattr(out, "last_hidden_state") else out, \
        ref.last_hidden_state if hasattr(ref, "last_hidden_state") else ref
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


MODES = [("JIT launches (before)", False), ("direct launches", True)] * 2  # alternated: the host's speed drifts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", default="resnet50:32,hf-bert-base:32")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    small = torch.zeros(8, device="cuda")
    add_us = host_us(lambda t: torch.add(t, 1), small, 2000)
    result, lines = {"host_add_us": add_us, "jobs": {}}, [f"one aten add on this host: {add_us:.1f} us"]
    compiled, train_jobs = {}, {}
    for job in args.jobs.split(","):  # every job compiled before the timers go in (they replace the ops' targets)
        name, batch, *train = job.split(":")
        model, (x,) = models.load(name, int(batch), torch.float16, "cuda")
        if train:  # a training step (fp16 weights, SGD) on the heuristic configs: every op on our kernels
            steps = {}
            for peer in ("eager", "resfuse"):
                torch.manual_seed(0)
                m = copy.deepcopy(model).train()
                opt = torch.optim.SGD(m.parameters(), lr=1e-4)
                torch._dynamo.reset()
                fn = m if peer == "eager" else resfuse.compile(m, tuning="none")
                steps[peer] = functools.partial(train_step, fn, opt)
            eager_us = host_us(steps["eager"], x, args.calls)
            train_jobs[job] = (steps["resfuse"], x, eager_us)
            continue
        with torch.no_grad():
            eager_us = host_us(model, x, args.calls)
            ref = model(x)
            torch._dynamo.reset()
            fn = resfuse.compile(model, cuda_graphs=False)
            fn(x)
        compiled[job] = (fn, x, ref, eager_us)
    summary = ["uninstrumented, us of host time a call (a training step for :train jobs):"]
    for job, (fn, x, *_, eager_us) in [*compiled.items(), *train_jobs.items()]:
        for mode, direct in MODES:
            set_mode(direct)
            with torch.no_grad() if job in compiled else contextlib.nullcontext():
                us = host_us(fn, x, args.calls)
            result["jobs"].setdefault(job, {"eager_us": eager_us, "clean": [], "modes": {}})["clean"].append(
                (mode, us))
            summary.append(f"{job:18} {mode:22} {us:9.0f} us a call (eager {eager_us:.0f})")
    instrument()
    summary.append("instrumented (timers add their own):")
    for job, (fn, x, ref, eager_us) in compiled.items():
        for i, (mode, direct) in enumerate(MODES):
            set_mode(direct)
            with torch.no_grad():
                us = host_us(fn, x, args.calls)  # timers on: a few us of their own per wrapped call
                err = rel_err(fn(x), ref)
            rows = {k: (COUNTS[k] / args.calls, TIMES[k] / args.calls * 1e6) for k in sorted(TIMES)}
            result["jobs"][job]["modes"][f"{mode} {i // 2 + 1}"] = {"resfuse_us": us, "rel_err": err, "rows": rows}
            summary.append(f"{job:18} {mode:22} {us:9.0f} us a call (eager {eager_us:.0f}), rel err {err:.1e}")
            if i < len(MODES) - 2:
                continue  # the last round's tables only; the JSON has every round's
            lines.append(f"\n{job}, {mode}: resfuse cuda_graphs=False {us:.0f} us a call, eager {eager_us:.0f}")
            lines.append(f"{'layer':52} {'calls':>6} {'us/model call':>14} {'us each':>8}")
            for k, (n, t) in rows.items():
                lines.append(f"{k:52} {n:6.1f} {t:14.1f} {t / max(n, 1e-9):8.1f}")
    text = "\n".join(lines + [""] + summary)
    print(text)
    with open(os.path.join(args.out, "host_split.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
