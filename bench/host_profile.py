"""Where resfuse's host time goes, and what CUDA graphs recover (GPU machine).

  python3 bench/host_profile.py [--model resnet50 mobilenet_v3_large] [--batch 1] --out $OUT

Compiles the model with resfuse (fp16, channels_last), checks it against eager, times resfuse with
cuda_graphs=False, True and the default beside torch.compile reduce-overhead (CUDA events, median of 50
calls), and cuda_graphs=False again over the harness's 4 rotated input sets ("resfuse rotated"), then runs
cProfile over 20 uncaptured calls of each job, rotating the sets, and prints the functions with the most own
and cumulative time. Full profile in $OUT/host_profile.txt.
"""
import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402


def median_ms(fn, sets, iters=50):
    """Median CUDA-event latency of fn over the input sets, in turn (the harness's timer)."""
    return timing.latency(fn, sets, sets[0][0].device, iters, warmup=5).median_ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", nargs="+", default=["resnet50"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    rows, report = [], io.StringIO()
    for name, batch in [(m, b) for m in args.model for b in args.batch]:
        model, (x,) = models.load(name, batch, torch.float16, "cuda")
        with torch.no_grad():
            ref = model(x).float()
            peers = {}
            torch._dynamo.reset()
            peers["reduce-overhead"] = torch.compile(model, mode="reduce-overhead")
            peers["resfuse"] = resfuse.compile(model, cuda_graphs=False)
            peers["resfuse+graphs"] = resfuse.compile(model, cuda_graphs=True)
            peers["resfuse default"] = resfuse.compile(model)  # inference on CUDA: graphs, as above
            res = {}
            sets = timing.input_sets((x,))
            for peer, fn in peers.items():
                out = fn(x).float()
                err = ((out - ref).norm() / ref.norm()).item()
                res[peer] = (median_ms(fn, [(x,)]), err)
            res["resfuse rotated"] = (median_ms(peers["resfuse"], sets), res["resfuse"][1])
            prof = cProfile.Profile()
            fn = peers["resfuse"]
            prof.enable()
            for i in range(20):
                fn(*sets[i % len(sets)])
            torch.cuda.synchronize()
            prof.disable()
            s = io.StringIO()
            for order in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=s).sort_stats(order).print_stats(40)
            report.write(f"==== {name} bs{batch}: 20 calls\n{s.getvalue()}")
        rows.append((name, batch, res))
    with open(os.path.join(args.out, "host_profile.txt"), "w") as f:
        f.write(report.getvalue())
    print(f"\nfp16 channels_last, median ms (rel err vs eager) on {torch.cuda.get_device_name()}")
    for name, batch, res in rows:
        print(f"{name} bs{batch}: " + "  ".join(f"{k} {t:.3f} ({e:.1e})" for k, (t, e) in res.items()))


if __name__ == "__main__":
    main()
