"""Where a training step's time goes when it is not in kernels (GPU machine).

  python3 bench/step_gaps.py [--job resnet50:256] [--peers resfuse+graphs,resfuse+graphs-no-pdl,compile] --out $OUT

For each peer (bench/train.py's names): the step's CUDA-event time, as train.py times it, and the host's time
to issue one step; then, from a torch.profiler trace of 3 steps, each started on an idle GPU behind a tiny
marker kernel (the timer's start event stands in the same place): the GPU's busy time (the union of its kernels'
intervals, so PDL's overlapping kernels count once), the idle time from the marker to the step's first kernel
(host work before the first launch), the idle gaps between kernels by size, and the longest gaps with the kernels
either side. Traces go to $OUT, gzipped.
"""
import argparse
import collections
import gzip
import json
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import train  # noqa: E402

MARK = 7  # the marker's tensor size: its kernel's name is unique enough with the grid it gets


def gpu_events(path: str) -> list:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                  key=lambda e: e["ts"])


def steps_of(events: list, pause_us: float = 2000.0) -> list:
    """The events split where the GPU idled longer than `pause_us` (the sleeps between profiled steps)."""
    out = [[events[0]]]
    for a, b in zip(events, events[1:]):
        if b["ts"] - (a["ts"] + a["dur"]) > pause_us:
            out.append([])
        out[-1].append(b)
    return out


def analyse(step: list) -> dict:
    """Busy union, span, idle before the first kernel after the marker, gaps by size, the longest gaps."""
    marker, kernels = step[0], step[1:]
    start = marker["ts"] + marker["dur"]
    busy, end, holes, last_name = 0.0, start, [], "(marker)"
    for e in kernels:
        if e["ts"] > end:
            holes.append((e["ts"] - end, last_name, e["name"]))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        if e["ts"] + e["dur"] > end:
            end, last_name = e["ts"] + e["dur"], e["name"]
    sizes = collections.Counter()
    for us, *_ in holes:
        sizes[next((f"<{b}us" for b in (2, 5, 20, 100, 1000) if us < b), ">=1000us")] += us
    return {"span_us": end - start, "busy_us": busy, "idle_us": end - start - busy, "kernels": len(kernels),
            "first_idle_us": holes[0][0] if holes and holes[0][1] == "(marker)" else 0.0,
            "idle_by_gap_size_us": dict(sizes), "longest": sorted(holes, reverse=True)[:15],
            "after_memsets": collections.Counter(b["name"][:80] for a, b in zip(kernels, kernels[1:])
                                                 if a.get("cat") == "gpu_memset").most_common(12),
            "short_kernels": collections.Counter(e["name"][:60] for e in kernels if e["dur"] < 3).most_common(30)}


def host_ms(step, calls: int = 10) -> float:
    """Median host time to issue one step, started on an idle GPU, not waiting for it."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def run_peer(job: str, peer: str, iters: int, out: str) -> dict:
    name, batch = job.split(":")
    torch.manual_seed(0)
    base, data, loss_fn = train.MODELS[name](int(batch))
    torch._dynamo.reset()
    model = train.copy.deepcopy(base).train()
    compiled = train.peers()[peer](model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    step = train.step_fn(compiled, opt, loss_fn, data)
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    ms = train.step_ms(step, iters)
    mark = torch.zeros(MARK, device="cuda")
    path = os.path.join(out, f"trace_{name}_bs{batch}_{peer.replace('+', '_')}.json")  # no '+': $OUT drops it
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            torch.cuda.synchronize()
            time.sleep(0.01)
            mark.add_(1)
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    steps = [analyse(s) for s in steps_of(gpu_events(path))]
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    row = {"ms": ms, "host_ms": host_ms(step), "steps": steps}
    del compiled, model, opt, step
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--job", default="resnet50:256")
    p.add_argument("--peers", default="resfuse+graphs,resfuse+graphs-no-pdl,compile")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = {}
    for peer in args.peers.split(","):
        rows[peer] = run_peer(args.job, peer, args.iters, args.out)
        with open(os.path.join(args.out, "step_gaps.json"), "w") as f:
            json.dump(rows, f, indent=1)
        s = rows[peer]["steps"][-1]
        print(f"\n{peer}: step {rows[peer]['ms']:.2f} ms (events), host {rows[peer]['host_ms']:.2f} ms/step; last "
              f"profiled step: span {s['span_us'] / 1e3:.2f} ms, busy {s['busy_us'] / 1e3:.2f}, idle "
              f"{s['idle_us'] / 1e3:.2f} ({s['first_idle_us']:.0f} us before the first kernel), {s['kernels']} GPU ops")
        print("  idle by gap size (us):", {k: round(v) for k, v in s["idle_by_gap_size_us"].items()})
        for us, before, after in s["longest"]:
            print(f"  {us:8.1f} us  after {before[:70]}  before {after[:70]}")
        print("  kernels right after a memset:", s["after_memsets"])
        print("  kernels under 3 us:", s["short_kernels"])
    print(f"\n{'peer':<26}{'event ms':>9}{'host ms':>9}{'span':>8}{'busy':>8}{'idle':>8}{'first':>8}{'ops':>6}")
    for peer, r in rows.items():
        s = r["steps"][-1]
        print(f"{peer:<26}{r['ms']:>9.2f}{r['host_ms']:>9.2f}{s['span_us'] / 1e3:>8.2f}{s['busy_us'] / 1e3:>8.2f}"
              f"{s['idle_us'] / 1e3:>8.2f}{s['first_idle_us'] / 1e3:>8.2f}{s['kernels']:>6}")


if __name__ == "__main__":
    main()
