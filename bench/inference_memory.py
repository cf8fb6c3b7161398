"""What CUDA-graph replay (resfuse's default for inference on CUDA) costs in GPU memory (GPU machine).

  python3 bench/inference_memory.py [--model resnet50] [--batch 32 256] [--tuning none] [--peers ...] --out $OUT

For each batch: eager, torch.compile reduce-overhead, resfuse with cuda_graphs=False and resfuse's default each
run 5 calls under no_grad from an emptied allocator, and the table gives their peak allocated and reserved
memory (a replayed graph's private pool counts in reserved only), the median latency of 20 more calls, and what
stays allocated once the compiled model is gone (a leak: kernel plans holding tensors, say). resfuse runs with
tuning="none" unless --tuning says otherwise, so that no tuning scratch counts. Writes DIR/inference_memory.json.
"""
import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402

TUNING = {"level": "none"}
PEERS = {
    "eager": lambda m: m,
    "reduce-overhead": lambda m: torch.compile(m, mode="reduce-overhead"),
    "resfuse, cuda_graphs=False": lambda m: resfuse.compile(m, tuning=TUNING["level"], cuda_graphs=False),
    "resfuse default": lambda m: resfuse.compile(m, tuning=TUNING["level"]),
}


def measure(build, model, x) -> dict:
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn = build(model)
    with torch.no_grad():
        for _ in range(5):
            fn(x)
        torch.cuda.synchronize()
        peak = dict(allocated_gb=(torch.cuda.max_memory_allocated() - base) / 1e9,
                    reserved_gb=torch.cuda.max_memory_reserved() / 1e9)
        peak["ms"] = timing.latency(fn, [(x,)], x.device, 20, warmup=2).median_ms
    del fn
    torch._dynamo.reset()
    gc.collect()
    peak["left_gb"] = (torch.cuda.memory_allocated() - base) / 1e9
    return peak


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    p.add_argument("--tuning", default="none", help="resfuse's tuning level (fast: tuning scratch counts)")
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    TUNING["level"] = args.tuning
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cudnn.benchmark = True
    rows = []
    for batch in args.batch:
        model, (x,) = models.load(args.model, batch, torch.float16, "cuda")
        for name in args.peers:
            rows.append(dict(model=args.model, batch=batch, peer=name, **measure(PEERS[name], model, x)))
            print(json.dumps(rows[-1]), flush=True)
        del model, x
    with open(os.path.join(args.out, "inference_memory.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"\n{args.model} fp16 channels_last, no_grad, on {torch.cuda.get_device_name()}")
    print(f"tuning {args.tuning}")
    print(f"{'bs':>4} {'peer':28} {'peak allocated GB':>18} {'peak reserved GB':>17} {'ms':>8} {'left GB':>8}")
    for r in rows:
        print(f"{r['batch']:>4} {r['peer']:28} {r['allocated_gb']:18.2f} {r['reserved_gb']:17.2f} {r['ms']:8.3f} "
              f"{r['left_gb']:8.2f}")


if __name__ == "__main__":
    main()
