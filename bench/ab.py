"""A/B of resfuse's Config switches on the GPU machine, beside torch.compile's modes, one process per job.

Entry point: `python bench/ab.py [--jobs mobilenet_v3_large:32,...] [--peers "reduce-overhead,rf+graphs
remainder=eager,rf+graphs"] [--out DIR]`. A peer is a torch.compile mode (eager, compile, reduce-overhead) or `rf` /
`rf+graphs` (resfuse.compile, with cuda_graphs=True for the latter) followed by space-separated `option=value`
Config overrides (and `handouts=N`, CudaGraphed.HANDOUTS: 0 copies every output after the replay); `guards=NAME`
gives any peer but eager a torch.compiler guard filter (reduce-overhead guards=skip_guard_on_all_nn_modules_unsafe).
Per (model, batch), in one process, in the order given: the first resfuse variant tunes (fresh cache or not) and the
later ones read its tuning choices, so variants differ in their switches only. fp16, channels_last, CUDA-event
medians over rotated inputs (resfuse.bench.timing), errors against eager. A peer may be named more than once
(off,on,off,on): each run is its own row. A table prints last, its columns numbered in the order of --peers, each
job's latencies (ms, relative error) over the host's time a call (us, each call started on an idle GPU: where it
passes the GPU's time, the host sets the pace); the JSON goes to --out (ab.json), each job's peers a list in that
order. With --autocast the model keeps fp32 weights and each peer runs it under torch.autocast (fp16), as
mixed-precision inference does: the errors are then against eager under autocast. With --profile each peer's kernels
are profiled too (torch.profiler, per call): the busy time and launches print under the table; every kernel, and one
call's timeline (launch order, starts, durations), go to the JSON.
"""
from __future__ import annotations

import argparse
import ast
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
from resfuse.capture.cuda_graphs import CudaGraphed  # noqa: E402

HANDOUTS = CudaGraphed.HANDOUTS

PEERS = {
    "eager": lambda m: m,
    "compile": lambda m: torch.compile(m),
    "reduce-overhead": lambda m: torch.compile(m, mode="reduce-overhead"),
}


MODE_OPTIONS = {"compile": {}, "reduce-overhead": {"triton.cudagraphs": True}}  # torch.compile's modes as options


def variant(peer: str):
    """The callable-maker for a peer spec: a torch.compile mode, or `rf[+graphs] option=value ...`. Any peer but
    eager also takes `guards=NAME`, a torch.compiler guard filter (skip_guard_on_all_nn_modules_unsafe...) passed
    as torch.compile's guard_filter_fn, so the host's guard time a call is compared at the same guards."""
    head, *overrides = peer.split()
    options = {}
    for item in overrides:
        key, _, value = item.partition("=")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value  # a plain word: remainder=eager
    guards = options.pop("guards", None)
    guard_filter = getattr(torch.compiler, guards) if guards else None
    handouts = options.pop("handouts", None)
    if head in MODE_OPTIONS and guard_filter is not None and not options:
        return lambda m: torch.compile(m, options={**MODE_OPTIONS[head], "guard_filter_fn": guard_filter})
    if head in PEERS and not overrides:
        return PEERS[head]
    if head not in ("rf", "rf+graphs"):
        raise ValueError(f"peer {peer!r}: one of {', '.join(PEERS)} (all but eager may take guards=NAME), or "
                         "rf / rf+graphs with option=value overrides")
    options = {"cuda_graphs": head == "rf+graphs", **options}

    def make(m):
        if handouts is not None:  # a bench-only switch, reset before each peer (run_job)
            CudaGraphed.HANDOUTS = handouts
        return resfuse.compile(m, guard_filter_fn=guard_filter, **options)
    return make


def timeline(fn, sets: list[tuple], device: torch.device, iters: int = 3) -> list[dict]:
    """The kernels of one call (the last of `iters` profiled) in launch order: name, start (us from the call's
    first kernel), duration (us). Two peers' timelines side by side show which launch, or which gap, differs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(*sets[i % len(sets)])
            torch.cuda.synchronize(device)
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0),
                    key=lambda e: e.time_range.start)
    per_call, left = divmod(len(events), iters)
    if per_call == 0 or left:
        return []  # calls of unequal launch counts: no one call to show
    last = events[-per_call:]
    t0 = last[0].time_range.start
    return [{"name": e.name, "start_us": e.time_range.start - t0, "us": e.time_range.elapsed_us()} for e in last]


def run_job(name: str, batch: int, peers: list[str], iters: int, autocast: bool = False,
            profile: bool = False) -> dict:
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    model, inputs = models.load(name, batch, torch.float32 if autocast else torch.float16, device, image_size=224,
                                seq=384)
    if autocast:
        model = models.Autocast(model, torch.float16)
    sets = timing.input_sets(inputs)
    refs = timing.run_once(model, inputs)
    late_refs = timing.run_once(model, sets[-1])  # eager's output for the call checked after the timed ones
    rows = []  # in the order run: a peer named twice (alternating A/B) keeps both measurements
    for peer in peers:
        torch._dynamo.reset()
        CudaGraphed.HANDOUTS = HANDOUTS
        fn = None
        try:
            fn = variant(peer)(model)
            m = timing.measure(fn, sets, refs, late_refs, device, iters)
            report = getattr(fn, "resfuse_report", None)
            rows.append({"peer": peer, "ms": m.latency.median_ms, "first_s": m.first_s, "rel_err": m.rel_err,
                         "host_us": timing.host_us(fn, sets[0], device),
                         "notes": list(report.notes) if report else [],
                         "errors": list(report.errors) if report else []})
            if profile:  # the device's busy time a call beside its latency: the rest is the gaps between kernels
                kernels = timing.kernels(fn, sets, device)
                rows[-1].update(busy_us=sum(k["time_us"] for k in kernels),
                                launches=sum(k["calls"] for k in kernels), kernels=kernels,
                                timeline=timeline(fn, sets, device))
        except Exception as e:  # one peer failing must not hide the others
            traceback.print_exc()
            rows.append({"peer": peer, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(f"{name}:{batch} {peer}: { {k: v for k, v in rows[-1].items() if k not in ('kernels', 'timeline')} }",
              flush=True)
        del fn
        torch.cuda.empty_cache()
    return {"model": name, "batch": batch, "autocast": autocast, "device": torch.cuda.get_device_name(),
            "peers": rows}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", default="mobilenet_v3_large:32,efficientnet_b0:32,convnext_tiny:32,regnety_040:32")
    p.add_argument("--peers", default="eager,reduce-overhead,rf+graphs remainder=eager,rf+graphs")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--autocast", action="store_true", help="fp32 weights, each peer under torch.autocast (fp16)")
    p.add_argument("--profile", action="store_true",
                   help="each peer's kernels under torch.profiler (busy_us, launches, kernels in the JSON)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    peers = [s for s in args.peers.split(",") if s]
    for peer in peers:
        variant(peer)  # a misspelt peer fails here, not after the first job's minutes
    t0, results = time.time(), []
    for item in args.jobs.split(","):
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: skipped {item}")
            continue
        name, _, batch = item.rpartition(":")
        results.append(run_job(name, int(batch), peers, args.iters, args.autocast, args.profile))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "ab.json").write_text(json.dumps(results, indent=1))
    print("\n" + "\n".join(f"#{i + 1}: {peer}" for i, peer in enumerate(peers)))
    print(f"{'job':24s}" + "".join(f"{'#' + str(i + 1):>24s}" for i in range(len(peers))))
    for r in results:
        cells = r["peers"]
        print(f"{r['model'] + ':' + str(r['batch']):24s}" + "".join(
            f"{c['ms']:>14.3f} ({c['rel_err']:.0e})" if "ms" in c else f"{'error':>24s}" for c in cells))
        print(f"{'  host us a call':24s}" + "".join(f"{c.get('host_us', float('nan')):>24.1f}" for c in cells))
        if args.profile:
            print(f"{'  busy us (launches)':24s}" + "".join(
                f"{c['busy_us']:>16.1f} ({c['launches']:>4d})" if "busy_us" in c else f"{'':>24s}" for c in cells))


if __name__ == "__main__":
    main()
