"""Does a CUDA-graph call really take more GPU time than an un-graphed one, or is the GPU's clock lower? (GPU)

  python bench/sustained.py [--jobs resnet50:256,hf-bert-base:32] [--seconds 3] --out $OUT

The forty-sixth session's harness rows gave resfuse un-graphed less GPU time a call than resfuse+graphs at
ResNet-50 bs256 (5.780 against 5.973 ms) and BERT bs32 (4.459 against 4.690), and the reverse at the small
batches. The un-graphed calls' GPU time was timed over 4 or 1 calls queued behind a sleep (the GPU idle before),
the graphed calls' over 20 right after the latency loop's hundreds (the GPU busy for seconds before). A GPU held at
its power limit lowers its clock; this tells the two apart. Per job, both variants are timed:
- cool: one call behind a sleep (timing.gpu_us), after 2 s of an idle GPU, five times;
- hot: the same, each right after `seconds` of graphed calls back to back;
- sustained: the graphed variant's CUDA-event latency over `seconds` of calls back to back, and the energy a
  call (NVML's energy counter over those seconds, over the calls made); with --compile, torch.compile's default
  mode (un-graphed; at these batches the GPU sets its pace) the same way, for its energy a call beside ours.
A thread reads the SM clock, the power draw and the clock-event (throttle) reasons through NVML every 5 ms; each
phase reports the medians of the reads taken inside it. Prints a table; JSON to $OUT.
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
from resfuse.bench import models, timing  # noqa: E402


class PhaseClocks(timing.Clocks):
    """timing.Clocks' reads every 5 ms, each with the power draw and the temperature, tagged with the phase named in
    `self.phase` at the time of the read (None between phases)."""

    def __init__(self):
        super().__init__(torch.device("cuda"), every_s=0.005)
        if self._read is None:
            raise SystemExit("NVML (nvidia-ml-py) cannot read this GPU")
        self.phase = None
        sm_and_reasons, nv, h = self._read, self.nv, self.handle
        self._read = lambda: (self.phase, *sm_and_reasons(), nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                              nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))

    def summary(self, phase: str) -> dict:
        reads = [r for r in self.reads if r[0] == phase]  # (phase, MHz, reasons, W, C)
        if not reads:
            return {}
        reasons = 0
        for r in reads:
            reasons |= r[2]
        return {"sm_mhz": statistics.median(r[1] for r in reads), "min_sm_mhz": min(r[1] for r in reads),
                "watts": statistics.median(r[3] for r in reads), "max_watts": max(r[3] for r in reads),
                "reasons": hex(reasons), "temp_c": max(r[4] for r in reads), "reads": len(reads)}


def run_for(fn, sets, seconds: float, clocks: PhaseClocks | None = None) -> tuple[float, float | None]:
    """Calls back to back for `seconds`: the median CUDA-event latency of the last third's calls, ms, and with
    `clocks` the joules a call over all of them (NVML's energy counter, mJ, read before and after)."""
    nv = clocks and clocks.nv
    t_end = time.perf_counter() + seconds
    times = []
    with torch.no_grad():
        torch.cuda.synchronize()
        mj = nv.nvmlDeviceGetTotalEnergyConsumption(clocks.handle) if nv else None
        while time.perf_counter() < t_end:
            times += timing._cuda_event_times(fn, sets, 10)
        joules = (nv.nvmlDeviceGetTotalEnergyConsumption(clocks.handle) - mj) / 1e3 / len(times) if nv else None
    return statistics.median(times[-max(10, len(times) // 3):]), joules


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", default="resnet50:256,hf-bert-base:32")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="torch.compile's default mode's sustained row too")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    with PhaseClocks() as clocks:
        results, rows = {}, []
        for job in args.jobs.split(","):
            name, batch = job.split(":")
            model, inputs = models.load(name, int(batch), torch.float16, "cuda")
            sets = timing.input_sets(inputs)
            torch._dynamo.reset()
            variants = {"graphs": resfuse.compile(model, cuda_graphs=True),
                        "no graphs": resfuse.compile(model, cuda_graphs=False)}
            with torch.no_grad():
                for fn in variants.values():
                    for s in sets:
                        fn(*s)
                torch.cuda.synchronize()
            res = results[job] = {}
            graphed = variants["graphs"]
            for variant, fn in variants.items():
                for state in ("cool", "hot"):
                    phase = f"{job} {variant} {state}"
                    times = []
                    for _ in range(args.repeats):
                        clocks.phase = None
                        if state == "cool":
                            time.sleep(2.0)
                        else:
                            run_for(graphed, sets, args.seconds)
                        clocks.phase = phase
                        times.append(timing.gpu_us(fn, sets, calls=1) / 1e3)
                    clocks.phase = None
                    res[phase] = {"ms": statistics.median(times), "all_ms": times, **clocks.summary(phase)}
            for variant in ("graphs", "compile") if args.compile else ("graphs",):
                if variant == "compile":  # after ours: the reset drops our compiled graphs
                    torch._dynamo.reset()
                    fn = torch.compile(model)
                    with torch.no_grad():
                        for s in sets:
                            fn(*s)
                else:
                    fn = graphed
                phase = f"{job} {variant} sustained"
                time.sleep(2.0)
                clocks.phase = phase
                ms, joules = run_for(fn, sets, args.seconds, clocks)
                clocks.phase = None
                res[phase] = {"ms": ms, "joules_a_call": joules, **clocks.summary(phase)}
            for phase, r in res.items():
                joules = r.get("joules_a_call")
                rows.append(f"{phase:<40} {r['ms']:8.3f} {r.get('sm_mhz', 0):7.0f} {r.get('min_sm_mhz', 0):7.0f} "
                            f"{r.get('watts', 0):6.0f} {r.get('max_watts', 0):6.0f} {r.get('temp_c', 0):4d} "
                            f"{r.get('reasons', '-'):>8} {'-' if joules is None else format(joules, '.2f'):>6}")
            print("\n".join(rows[-len(res):]), flush=True)
            del variants, graphed, fn
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "sustained.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{'phase':<40} {'ms':>8} {'SM MHz':>7} {'min':>7} {'W':>6} {'max W':>6} {'C':>4} {'reasons':>8} "
          f"{'J/call':>6}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
