"""The host's time a call, A/B of CudaGraphed's handouts, interleaved (GPU machine).

  python bench/host_ab.py [--model resnet50 mobilenet_v3_large] [--batch 1] [--rounds 200] --out $OUT

The H100 machines' hosts are noisy: the same call's host time moves 2-5x from one second to the next
(bench/host_settle.py), so peers timed one after the other (bench/ab.py) compare time windows, not code. Here one
compiled model (resfuse, CUDA graphs) switches CudaGraphed.HANDOUTS between 2 (outputs handed out from graphs that
copy them inside) and 0 (each output cloned after the replay) every few calls, so both variants share every window:
per round, 5 calls of each, each started on an idle GPU (resfuse.bench.timing.host_us), then 20 back-to-back calls
of each timed by CUDA events. Prints the medians and the median of the rounds' differences, and the host's time in
the graph's graph.replay() alone, started on an idle GPU and back to back; JSON to $OUT.
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
from resfuse.capture.cuda_graphs import CudaGraphed  # noqa: E402

VARIANTS = {"handouts": CudaGraphed.HANDOUTS, "clone": 0}
MADE = []  # every CudaGraphed made in this process, in order
_init = CudaGraphed.__init__
CudaGraphed.__init__ = lambda self, *args, **kwargs: MADE.append(self) or _init(self, *args, **kwargs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", nargs="+", default=["resnet50", "mobilenet_v3_large"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    results = {}
    for name in args.model:
        model, inputs = models.load(name, args.batch, torch.float16, "cuda")
        torch._dynamo.reset()
        fn = resfuse.compile(model)
        device = inputs[0].device
        for _ in range(5):  # first call, capture, and both handouts captured
            timing.run_once(fn, inputs)
        host = {v: [] for v in VARIANTS}
        lat = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant, n in VARIANTS.items():
                CudaGraphed.HANDOUTS = n
                host[variant].append(timing.host_us(fn, inputs, device, calls=5))
                lat[variant].append(timing.latency(fn, [inputs], device, 20, warmup=1).median_ms * 1e3)
        CudaGraphed.HANDOUTS = VARIANTS["handouts"]
        graphed = MADE[-1]  # this model's inference graph
        replay = graphed.last.graph.replay
        idle = timing.host_us(replay, (), device, calls=100)  # each replay started on an idle GPU
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):  # back to back: the queue fills, the host's enqueue cost alone
            replay()
        busy = (time.perf_counter() - t0) * 1e4
        torch.cuda.synchronize()
        print(f"{name}: graph.replay() host us {idle:.1f} on an idle GPU, {busy:.1f} back to back")
        row = {}
        for what, series in (("host_us", host), ("latency_us", lat)):
            a, b = series["handouts"], series["clone"]
            row[what] = {"handouts": statistics.median(a), "clone": statistics.median(b),
                         "median difference": statistics.median(x - y for x, y in zip(a, b))}
        results[f"{name}:{args.batch}"] = row | {"replay_us": {"idle": idle, "back to back": busy},
                                                 "series": {"host_us": host, "latency_us": lat}}
        print(f"{name} bs{args.batch}, {args.rounds} rounds: " + "; ".join(
            f"{what} handouts {r['handouts']:.1f} clone {r['clone']:.1f} (median difference "
            f"{r['median difference']:+.1f})" for what, r in row.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_ab.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
