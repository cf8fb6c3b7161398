"""Every call's output against eager's on the same input, not only the first call's (GPU machine).

  python bench/replay_check.py [--jobs resnet50:1,resnet50:32] [--variants "cuda_graphs=True;cuda_graphs=False"]
      [--pdl-off plan,chain] [--plans-pdl off:conv2d_fprop] [--reduce-overhead-first]

The harness's error column was the first call's until the thirty-eighth session, and resfuse's first call runs
before any CUDA graph is captured, so a wrong replay did not show there. Here each variant is compiled once and
called over the harness's rotated input sets and then on one tensor again and again (as bench/replay_gaps.py calls
it); each call's output is compared with eager's for that input. Prints one line per variant with every call's
relative error, and the report's errors (a graph dropped by CudaGraphed's own check). --pdl-off and --plans-pdl
switch programmatic dependent launch per kernel module or per plan kernel, to find a kernel whose dependent launch
breaks a replay (how the thirty-eighth session found the 1x1 conv on resfuse_conv2d_fprop).

--check-ops adds a last variant whose every resfuse op is followed by a synchronize and by the same op on its ATen
path (provider "aten"), on the same inputs; an op whose output differs (relative error over 1e-2, or non-finite
where ATen's is finite) is printed with its shapes, its epilogue and the tuner's choice. The synchronize also ends
any overlap between ops: a wrong model output that these checks do not reproduce points at ordering between ops
(a dependent launch), not at one op's kernel.
"""
import argparse
import ast
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402


def errors(fn, sets, refs, same_calls: int) -> list[float]:
    errs = []
    for i in range(2 * len(sets)):
        errs.append(timing.output_error(timing.run_once(fn, sets[i % len(sets)]), refs[i % len(sets)])[0])
    for _ in range(same_calls):  # one tensor, call after call
        errs.append(timing.output_error(timing.run_once(fn, sets[0]), refs[0])[0])
    return errs


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)}{'' if value.is_contiguous() else ' strided ' + str(value.stride())}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return repr(value)


def _choice(name: str, bound) -> str:
    if name not in ("conv2d", "conv2d_aux", "gemm", "gemm_aux"):
        return "-"
    from resfuse.ops import fused
    from resfuse.tuning.choose import choose

    a = bound.arguments
    inputs = (a["x"], a["weight"]) if "x" in a else (a["a"], a["b"])
    params = (a["stride"], a["padding"], a["dilation"]) if "x" in a else (a["out_shape"],)
    choice = choose(fused.call_of(name.removesuffix("_aux"), inputs, a["operands"], a["epilogue"], params))
    return f"{choice.provider} {choice.config}"


def check_ops(bad: list) -> None:
    """Every resfuse op checked against its own ATen path after it runs (see --check-ops); `bad` collects lines."""
    import inspect

    from resfuse import ops

    if hasattr(check_ops, "lib"):
        return
    # a backend kernel outranks the ops' CompositeExplicitAutograd one
    lib = check_ops.lib = torch.library.Library("resfuse", "IMPL")
    key = "CUDA" if torch.cuda.is_available() else "CPU"
    for target, impl in list(ops.IMPLS.items()):
        name, signature = target.name().split("::")[1], inspect.signature(impl)

        def checked(*args, _impl=impl, _name=name, _signature=signature, **kwargs):
            out = _impl(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            bound = _signature.bind(*args, **kwargs)
            bound.arguments["provider"] = "aten"
            ref = _impl(*bound.args, **bound.kwargs)
            outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
            for i, (o, r) in enumerate(zip(outs, refs)):
                if not isinstance(o, torch.Tensor) or not o.is_floating_point():
                    continue
                err = timing.output_error([o], [r])[0]
                if err > 1e-2:
                    bound.arguments["provider"] = "triton"
                    args = {k: _describe(v) for k, v in bound.arguments.items()}
                    bad.append(f"{_name} output {i}: relative error {err:.1e}; {args}; choice {_choice(_name, bound)}")
                    print(bad[-1], flush=True)
            return out
        ops.IMPLS[target] = checked
        lib.impl(name, checked, key)


def plans_pdl(state: str, what: str) -> None:
    """Programmatic dependent launch switched on or off for the plans (plan.Plan) that `what` names, from now on."""
    from resfuse.kernels import plan

    init = plan.Plan.__init__

    def patched(self, kernel, grid, head, strides, meta, ws_shape, device, *rest, **kw):
        init(self, kernel, grid, head, strides, meta, ws_shape, device, *rest, **kw)
        if ws_shape[1] > 1 if what == "split" else what in kernel.__name__:
            pdl = plan.pdl_meta(device) if state == "on" else {"PDL": False}
            self.meta = {**{k: v for k, v in self.meta.items() if k != "launch_pdl"}, **pdl}  # PREFETCH kept
            self.kernel = plan.Launcher(kernel, grid, self.meta)
        print(f"plan {kernel.__name__} grid {grid} split {ws_shape[1]}: PDL {self.meta['PDL']}")
    plan.Plan.__init__ = patched


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", default="resnet50:1,resnet50:32")
    p.add_argument("--variants", default="cuda_graphs=True;cuda_graphs=False",
                   help="';'-separated, each a space-separated list of resfuse.compile option=value")
    p.add_argument("--same-calls", type=int, default=3)
    p.add_argument("--reduce-overhead-first", action="store_true",
                   help="compile and call torch.compile(mode='reduce-overhead') first, as bench/replay_gaps.py does")
    p.add_argument("--pdl-off", default="", help="comma list of resfuse.kernels modules (plan, chain, shortcut, "
                   "conv2d_image, max_pool, padding, batch_norm) whose kernels launch without PDL")
    p.add_argument("--check-ops", action="store_true", help="a last variant, the first one's options with every "
                   "resfuse op checked against its ATen path after it runs")
    p.add_argument("--plans-pdl", default="", help="off:TEXT or on:TEXT: PDL off (on) for plan.Plan kernels whose "
                   "name holds TEXT, or 'split' for split-K plans")
    args = p.parse_args()
    if args.plans_pdl:
        plans_pdl(*args.plans_pdl.split(":", 1))
    for name in filter(None, args.pdl_off.split(",")):  # each module's own binding of plan.pdl_meta
        module = importlib.import_module(f"resfuse.kernels.{name}")
        module.pdl_meta = lambda device: {"PDL": False}
    torch.backends.cudnn.benchmark = True
    bad = 0
    for job in args.jobs.split(","):
        name, _, batch = job.rpartition(":")
        model, inputs = models.load(name, int(batch), torch.float16, torch.device("cuda"), image_size=224, seq=384)
        sets = timing.input_sets(inputs)
        refs = [timing.run_once(model, s) for s in sets]
        if args.reduce_overhead_first:
            torch._dynamo.reset()
            print(f"{job} reduce-overhead: worst {max(errors(torch.compile(model, mode='reduce-overhead'), sets, refs, 3)):.1e}")
        specs = args.variants.split(";") + ([args.variants.split(";")[0] + " check_ops"] if args.check_ops else [])
        for spec in specs:
            if spec.endswith("check_ops"):
                spec, found = spec.removesuffix("check_ops").strip(), []
                check_ops(found)
                print(f"{job}: checking every op against its ATen path", flush=True)
            options = {k: ast.literal_eval(v) for k, _, v in (item.partition("=") for item in spec.split())}
            torch._dynamo.reset()
            fn = resfuse.compile(model, **options)
            errs = errors(fn, sets, refs, args.same_calls)
            worst = max(errs)
            bad += worst > 1e-2
            report = getattr(fn, "resfuse_report", None)
            if report is not None and report.errors:
                print(f"{job} {spec}: the report's errors: {report.errors}")
            print(f"{job} {spec}: worst {worst:.1e}; per call {' '.join(f'{e:.1e}' for e in errs)}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
