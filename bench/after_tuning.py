"""Why a model's CUDA-graph replays jitter right after it tuned cold in the same process (GPU machine).

Entry point: `python bench/after_tuning.py [--model resnext50_32x4d] [--batch 1] [--seconds 70]`. The fortieth
session's zoo measured ResNeXt-50 bs1 under resfuse+graphs at 0.479 ms (0.378-0.530) in the job that tuned it,
and 0.312 ms (0.310-0.314) in a later job that found its choices cached. This script tunes the model cold (a fresh
tuning cache), then for --seconds samples, once a second: the median of 20 graphed calls timed with CUDA events,
how many compile workers live and the CPU they used that second, and how many queued compiles are not done yet.
If the replays settle when the workers go idle or exit, the workers' leftover compiles are what slows the host.
The first call of each window follows a second of idle GPU, as a served request at bs1 often does;
--reduce-overhead N samples torch.compile's CUDA graphs the same way afterwards, for comparison.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse  # noqa: E402
from resfuse.bench import models  # noqa: E402
from resfuse.tuning import workers  # noqa: E402


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, IndexError):
        return 0.0


def pids() -> list[int]:
    return [w.proc.pid for pool in workers.POOLS.values() for w in (pool["workers"] or ())]


def sample(fn, inputs, seconds: int) -> None:
    """Once a second, 20 calls timed with CUDA events: the first (after the GPU idled since the last window), and
    the median, min and max of the other 19; the compile workers alive and their CPU that second; compiles queued."""
    print(f"{'s':>4} {'first ms':>9} {'median':>7} {'min':>7} {'max':>7} {'workers':>8} {'their cpu s':>12} "
          f"{'queued':>7}")
    start = time.perf_counter()
    before = {pid: cpu_s(pid) for pid in pids()}
    while time.perf_counter() - start < seconds:
        tick = time.perf_counter()
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(*inputs)
            b.record()
            times.append((a, b))
        torch.cuda.synchronize()
        first, *ms = [a.elapsed_time(b) for a, b in times]
        now = {pid: cpu_s(pid) for pid in pids()}
        used = sum(now[pid] - before.get(pid, 0.0) for pid in now)
        pending = sum(not f.done() for f in list(workers.QUEUED.values()))
        print(f"{tick - start:4.0f} {first:9.3f} {statistics.median(ms):7.3f} {min(ms):7.3f} {max(ms):7.3f} "
              f"{len(now):8d} {used:12.2f} {pending:7d}", flush=True)
        before = now
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - tick)))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnext50_32x4d")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seconds", type=int, default=70)
    p.add_argument("--warm", action="store_true", help="keep RESFUSE_CACHE_DIR's choices (default: tune cold)")
    p.add_argument("--reduce-overhead", type=int, default=0, metavar="SECONDS",
                   help="then sample torch.compile reduce-overhead as long, in the same process")
    args = p.parse_args()
    if not args.warm:
        os.environ["RESFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="resfuse_cold_")
    model, inputs = models.load(args.model, args.batch, torch.float16, torch.device("cuda"), image_size=224, seq=384)
    fn = resfuse.compile(model, cuda_graphs=True)
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(*inputs)
        torch.cuda.synchronize()
        print(f"{args.model} bs{args.batch} resfuse+graphs: first call {time.perf_counter() - t0:.1f} s", flush=True)
        sample(fn, inputs, args.seconds)
        if args.reduce_overhead:
            ro = torch.compile(model, mode="reduce-overhead")
            for _ in range(3):
                ro(*inputs)
            torch.cuda.synchronize()
            print(f"{args.model} bs{args.batch} reduce-overhead:", flush=True)
            sample(ro, inputs, args.reduce_overhead)
    return 0


if __name__ == "__main__":
    sys.exit(main())
