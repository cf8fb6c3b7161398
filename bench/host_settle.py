"""Is the host slower right after a compile? (GPU machine; a probe of the "slow windows" at batch 1.)

  python bench/host_settle.py [--model mobilenet_v3_large] [--batch 1] [--seconds 40] [--cold] --out $OUT

The first peer of each job in `bench/ab.py` sometimes spends half as much again host time a call as the same
code a minute later (MobileNetV3-L bs1: 452 against 295-303 us, forty-fourth session), and at batch 1 the host
sets the pace. This compiles the model with resfuse (CUDA graphs; --cold: into an empty Triton cache, as on a
fresh machine, so its first call compiles every kernel), then every second for --seconds: the host's time a call
(resfuse.bench.timing.host_us), the latency (CUDA events, back to back), the CPU clock (/proc/cpuinfo's mean MHz),
the load average, and the CPU time used since the last sample by this process's children (compile workers) and
by its other threads. A table prints; the series goes to $OUT/host_settle.json.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def cpu_mhz() -> float:
    with open("/proc/cpuinfo") as f:
        mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    return sum(mhz) / len(mhz) if mhz else float("nan")


def cpu_seconds() -> tuple[float, float]:
    """(this process's CPU seconds, its waited-for and live children's), from /proc."""
    own = time.process_time()
    children = 0.0
    me = str(os.getpid())
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # ppid
            children += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return own, children


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mobilenet_v3_large")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seconds", type=int, default=40)
    p.add_argument("--cold", action="store_true", help="an empty Triton cache: the first call compiles every kernel")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.cold:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cold_")
    import resfuse
    from resfuse.bench import models, timing

    torch.backends.cudnn.benchmark = True
    model, inputs = models.load(args.model, args.batch, torch.float16, "cuda")
    fn = resfuse.compile(model)
    t0 = time.perf_counter()
    first = timing.first_call(fn, inputs, inputs[0].device)[0]
    for _ in range(3):
        timing.run_once(fn, inputs)  # the capture
    rows, last = [], cpu_seconds()
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        tick = time.perf_counter()
        host = timing.host_us(fn, inputs, inputs[0].device, calls=30)
        lat = timing.latency(fn, [inputs], inputs[0].device, 60, warmup=3).median_ms * 1e3
        now = cpu_seconds()
        rows.append({"s_after_compile": round(time.perf_counter() - t0, 1), "host_us": round(host, 1),
                     "latency_us": round(lat, 1), "cpu_mhz": round(cpu_mhz()), "load1": os.getloadavg()[0],
                     "own_cpu_s": round(now[0] - last[0], 2), "children_cpu_s": round(now[1] - last[1], 2)})
        last = now
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - tick)))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_settle.json"), "w") as f:
        json.dump({"model": args.model, "batch": args.batch, "cold": args.cold, "first_call_s": first,
                   "series": rows}, f, indent=1)
    print(f"{args.model} bs{args.batch}, first call {first:.1f} s ({'cold' if args.cold else 'warm'} Triton cache)")
    print(f"{'s':>6}{'host us':>9}{'lat us':>8}{'MHz':>7}{'load1':>7}{'own cpu s':>10}{'children cpu s':>15}")
    for r in rows:
        print(f"{r['s_after_compile']:>6}{r['host_us']:>9}{r['latency_us']:>8}{r['cpu_mhz']:>7}{r['load1']:>7.2f}"
              f"{r['own_cpu_s']:>10}{r['children_cpu_s']:>15}")


if __name__ == "__main__":
    main()
