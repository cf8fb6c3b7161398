"""The host's time an un-graphed call, A/B of the forty-sixth session's trims of the cuDNN path, interleaved (GPU).

  python bench/host_trims.py [--jobs resnet50:1,resnet50:32] [--rounds 30] [--calls 10] --out $OUT

The trims: a Call's fast key computed once (choose.Call.problem) instead of again in the cuDNN provider's plan
lookup; a fold found by its sources' ids (fold_bn.folded_call) instead of by their addresses, shapes, strides and
dtypes; cudnn.Plan.run setting its handle's stream only when the current one changed, read as a raw pointer, and
allocating no workspace for an engine config that needs none. "before" patches the replaced code back in (the
Fold's own holds/refresh stay the new ones, which read 5 addresses more a refresh). One compiled model per job
(cuda_graphs=False, the tuning cache as carried) alternates the two every round, so both share each of the
host's time windows (bench/host_ab.py says why); per round, `calls` calls of each, timed on the host and
synchronized after. Prints each job's median host us a call and the median of the rounds' differences; JSON to $OUT.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse.bench import models  # noqa: E402
from resfuse.providers import cudnn, fold_bn  # noqa: E402
from resfuse.tuning import choose  # noqa: E402


def old_fast_key(call):
    """Computed again at each ask, as before; the new key's order, so both variants share one set of choices."""
    return (call.op, call.signature, str(call.params), call.out,
            *[(t.shape, t.stride(), t.dtype) for t in (*call.inputs, *call.operands)], choose._SETTINGS["providers"])


def old_folded_call(call):
    _, bn = fold_bn._folded(call.signature, len(call.operands))
    w = call.inputs[1]
    sources = (w, *(call.operands[o.slot] for o in bn.args[1:]))
    key = (tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in sources), bn.params[0])
    fold = OLD_FOLDS.get(key)
    if fold is None or not fold.holds(sources):
        fold = OLD_FOLDS[key] = fold_bn.Fold(w, sources[1:], bn.params[0])
    else:
        fold.refresh()
    return fold_bn.folded_form(call, fold.w, fold.shift) if fold.fits else None


def old_plan_run(self, call, out, engine=None):
    index = self.engines.index(engine) if engine in self.engines else 0
    if engine not in self.built:
        NEW["plan_run"](self, call, out, engine)  # builds it
    cudnn._cudnn().set_stream(self.handle, torch.cuda.current_stream().cuda_stream)
    self.stream = None
    binding = {self.x: call.inputs[0], self.w: call.inputs[1], self.y: out}
    for slot, tensor in self.operands.items():
        binding[tensor] = self._operand(call, slot)
    for value, tensor in self.scalars.items():
        binding[tensor] = self.host_scalars[value]
    workspace = torch.empty(max(1, self.built[engine][1]), dtype=torch.uint8, device=out.device)
    self.graph.execute_plan_at_index(binding, workspace, index=index, handle=self.handle)
    return out


OLD_FOLDS: dict = {}
NEW = {"fast_key": choose.fast_key, "folded_call": cudnn.folded_call, "plan_run": cudnn.Plan.run}
OLD = {"fast_key": old_fast_key, "folded_call": old_folded_call, "plan_run": old_plan_run}


def use(code: dict) -> None:
    choose.fast_key = code["fast_key"]  # choose() and cudnn._plan read the module's name at each call
    cudnn.folded_call = code["folded_call"]
    cudnn.Plan.run = code["plan_run"]


def host_us(fn, x, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", default="resnet50:1,resnet50:32")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    results = {}
    for job in args.jobs.split(","):
        name, batch = job.split(":")
        model, (x,) = models.load(name, int(batch), torch.float16, "cuda")
        with torch.no_grad():
            ref = model(x).float()
            torch._dynamo.reset()
            fn = resfuse.compile(model, cuda_graphs=False)
            series = {"before": [], "after": []}
            errs = {}
            for variant, code in (("before", OLD), ("after", NEW)):
                use(code)
                out = fn(x).float()
                errs[variant] = ((out - ref).norm() / ref.norm()).item()
                host_us(fn, x, 5)
            for _ in range(args.rounds):
                for variant, code in (("before", OLD), ("after", NEW)):
                    use(code)
                    series[variant].append(host_us(fn, x, args.calls))
            use(NEW)
        diff = statistics.median(b - a for a, b in zip(series["before"], series["after"]))
        results[job] = {"series": series, "rel_err": errs, "median_diff_us": diff}
        print(f"{job}: host us a call, before {statistics.median(series['before']):.0f}, after "
              f"{statistics.median(series['after']):.0f}, median difference {diff:+.0f} "
              f"(rel err {errs['before']:.1e} / {errs['after']:.1e})", flush=True)
    with open(os.path.join(args.out, "host_trims.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
