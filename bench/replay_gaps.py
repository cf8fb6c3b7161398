"""Where a CUDA-graph replay's time goes when it is not in kernels (GPU machine).

  python3 bench/replay_gaps.py [--model mobilenet_v3_large efficientnet_b0] [--batch 1] [--guards] --out $OUT

For each model (fp16, channels_last, eval): resfuse's default (inference graphs replayed) and torch.compile
reduce-overhead. Per peer it prints the CUDA-event latency (the harness's timer), the host's time per call
when nothing waits for the GPU, and from a torch.profiler trace of 5 calls: the GPU's busy time per call and
the longest idle gaps between its kernels, with the kernels either side, and the garbage collector's work per
call. Traces go to $OUT.
"""
import argparse
import cProfile
import collections
import gc
import gzip
import io
import operator
import pstats
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402
from resfuse.capture.cuda_graphs import CudaGraphed  # noqa: E402


def split_us(fn, x, calls=50) -> dict:
    """Median host us of one whole call split at CudaGraphed's own call: before it (Dynamo's guards and
    aot_autograd's wrappers on the way in), inside it (check, copies, fold refresh, replay, output copies), and
    after it (the wrappers on the way out). Each call starts on an idle GPU."""
    stamps, parts = [], []
    plain = CudaGraphed.__call__

    def stamped(self, inputs):
        t = time.perf_counter()
        try:
            return plain(self, inputs)
        finally:
            stamps.append((t, time.perf_counter()))
    CudaGraphed.__call__ = stamped
    try:
        with torch.no_grad():
            for _ in range(calls):
                torch.cuda.synchronize()
                stamps.clear()
                t0 = time.perf_counter()
                fn(x)
                t3 = time.perf_counter()
                if len(stamps) == 1:
                    (t1, t2), = stamps
                    parts.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    finally:
        CudaGraphed.__call__ = plain
    torch.cuda.synchronize()
    med = lambda i: round(sorted(p[i] for p in parts)[len(parts) // 2] * 1e6, 1) if parts else None  # noqa: E731
    return {"before": med(0), "inside": med(1), "after": med(2), "whole": med(3), "calls split": len(parts)}


def _is_graphed(obj) -> bool:
    try:
        return isinstance(obj, CudaGraphed) and bool(obj.captures)
    except ReferenceError:  # a weakref proxy whose object is gone
        return False


def step_us(calls=50) -> dict:
    """Median host us of CudaGraphed's whole replaying call, and of each of its steps, on the first graph found
    among live objects: the input check (and its parts), the input copies, the replay, the outputs' copies, and
    where the signature has a handout graph its check, replay and outputs (each started on an idle GPU)."""
    from resfuse.capture import cuda_graphs
    from resfuse.capture.cuda_graphs import _masked, same_addresses, _signature

    graphed = next(o for o in gc.get_objects() if _is_graphed(o))
    cap = next(iter(graphed.captures.values()))
    args = tuple(cap.static)
    print("replays:", cap.replays(args), "C++ address check:",
          getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None) is not None, cuda_graphs.__file__)
    steps = {"whole call": lambda: graphed(list(args)), "check": lambda: cap.replays(args),
             "check: ids, as before": lambda: (_masked(list(map(id, args)), cap.not_fixed)
                                               == list(map(id, cap.fixed_objs))),
             "check: objects": lambda: all(map(operator.is_, _masked(args, cap.not_fixed), cap.fixed_objs)),
             "check: addresses": lambda: same_addresses(args, cap.fixed_ptrs, cap.fixed_idx),
             "check: addresses, Python": lambda: all(args[i].data_ptr() == cap.fixed_ptrs[i] for i in cap.fixed_idx),
             "check: copied signature": lambda: _signature([args[i] for i in cap.copied]),
             "copy in": lambda: [cap.static[i].copy_(args[i]) for i in cap.copied],
             "fold refresh": (cap.folds.refresh if cap.folds else lambda: None),
             "replay": cap.graph.replay, "copy out": lambda: [o.clone() for o in cap.outputs]}
    if cap.handouts:  # the graph whose outputs a call hands out, copied inside it (CudaGraphed._serve)
        steps |= {"handout free?": cap.handouts[0].free, "handout replay": cap.handouts[0].graph.replay,
                  "handout outputs": lambda: cap.handouts[0].outputs(list)}
    return {name: round(timing.host_us(step, (), torch.device("cuda"), calls), 1) for name, step in steps.items()} | {
        "inputs": len(args), "outputs": len(cap.outputs)}


def gc_census(fn, x, calls=50) -> str:
    """The garbage collector's work per call: collections per generation over `calls` calls, then the types of
    the objects that 10 calls left in reference cycles (each cycle is freed only by a collection)."""
    with torch.no_grad():
        gc.collect()
        before = [g["collections"] for g in gc.get_stats()]
        for _ in range(calls):
            fn(x)
        after = [g["collections"] for g in gc.get_stats()]
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        for _ in range(10):
            fn(x)
        gc.collect()
        kinds = collections.Counter(type(o).__name__ for o in gc.garbage)
        gc.set_debug(0)
        gc.garbage.clear()
    per_call = [round((b - a) / calls, 3) for a, b in zip(before, after)]
    return f"collections per call by generation {per_call}; left in cycles by 10 calls: {kinds.most_common(8)}"


def host_profile(fn, x, calls=50, top=14) -> str:
    """cProfile over `calls` calls: the functions with the most own time."""
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(calls):
            fn(x)
        prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def gaps(trace_path: str, calls: int, top: int = 12) -> tuple[float, float, list]:
    """(busy us per call, span us per call, the longest idle gaps) from a chrome trace's GPU events."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in gpu)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"] if gpu else 0.0
    holes = [(b["ts"] - (a["ts"] + a["dur"]), a["name"][:60], b["name"][:60]) for a, b in zip(gpu, gpu[1:])]
    holes.sort(reverse=True)
    return busy / calls, span / calls, holes[:top]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", nargs="+", default=["mobilenet_v3_large", "efficientnet_b0"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--guards", action="store_true",
                   help="also resfuse with torch.compiler.skip_guard_on_all_nn_modules_unsafe (peer resfuse+filter)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    makers = {"reduce-overhead": lambda m: torch.compile(m, mode="reduce-overhead"), "resfuse": resfuse.compile}
    if args.guards:
        makers["resfuse+filter"] = lambda m: resfuse.compile(
            m, guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe)
    rows = []
    for name in args.model:
        model, (x,) = models.load(name, args.batch, torch.float16, "cuda")
        with torch.no_grad():
            ref = model(x).float()
        for peer, make in makers.items():
            torch._dynamo.reset()
            fn = make(model)
            with torch.no_grad():
                for _ in range(3):
                    out = fn(x)
                err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                lat = timing.latency(fn, [(x,)], x.device, 50, warmup=5).median_ms * 1e3
                host = timing.host_us(fn, (x,), x.device)
                path = os.path.join(args.out, f"trace_{name}_bs{args.batch}_{peer}.json")
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        fn(x)
                    torch.cuda.synchronize()
            prof.export_chrome_trace(path)
            busy, span, holes = gaps(path, 5)
            with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(path)
            rows.append((name, peer, lat, host, busy, span, err))
            print(f"\n{name} bs{args.batch} {peer}: latency {lat:.1f} us, host {host:.1f} us/call, GPU busy "
                  f"{busy:.1f} us/call over a span of {span:.1f} us/call, rel err {err:.1e}; longest gaps:")
            for us, before, after in holes:
                print(f"  {us:8.1f} us  after {before}  before {after}")
            if peer.startswith("resfuse"):
                print("host us per step of CudaGraphed's call:", step_us())
                print("host us of a whole call, split at CudaGraphed's:", split_us(fn, x))
                gc.disable()
                with torch.no_grad():
                    bare = timing.host_us(fn, (x,), x.device)
                    print(f"host us per call without Python's garbage collector: {bare:.1f}")
                gc.enable()
            print("garbage collector:", gc_census(fn, x))
            print(host_profile(fn, x))
    print(f"\n{'model':<22}{'peer':<17}{'latency us':>11}{'host us':>9}{'busy us':>9}{'span us':>9}")
    for name, peer, lat, host, busy, span, _ in rows:
        print(f"{name:<22}{peer:<17}{lat:>11.1f}{host:>9.1f}{busy:>9.1f}{span:>9.1f}")


if __name__ == "__main__":
    main()
