"""What a training step's reserved memory is made of, pool by pool (GPU machine).

Entry point: `python bench/pool_memory.py --peer resfuse+graphs [--job resnet50:64] [--out DIR]`, one peer a
process (so no peer inherits another's cached segments). Builds the peer as bench/train.py does (SGD with
momentum, fp16 autocast, channels_last), runs a few steps, empties the caching allocator's unused cache as
train.py does before it measures, runs a few more steps, then sums torch.cuda.memory_snapshot()'s segments by
memory pool: the default pool, and each private pool (a CUDA graph tree's). For each: reserved (segments),
allocated (live blocks) and the largest free block. Prints the table and max_memory_reserved last; the rows go
to DIR/pool_memory_<peer>.json.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import MODELS, peers, step_fn  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peer", default="resfuse+graphs")
    p.add_argument("--job", default="resnet50:64")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    name, batch = args.job.split(":")
    model, data, loss_fn = MODELS[name](int(batch))
    model = peers()[args.peer](model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    step = step_fn(model, opt, loss_fn, data)
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    pools = collections.defaultdict(lambda: {"segments": 0, "reserved_mb": 0.0, "allocated_mb": 0.0,
                                             "largest_free_mb": 0.0})
    for seg in torch.cuda.memory_snapshot():
        pool = pools[str(tuple(seg.get("segment_pool_id", (0, 0))))]
        pool["segments"] += 1
        pool["reserved_mb"] += seg["total_size"] / 2**20
        pool["allocated_mb"] += seg["allocated_size"] / 2**20
        free = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
        pool["largest_free_mb"] = max(pool["largest_free_mb"], max(free, default=0) / 2**20)
    peak = {"max_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
            "max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9}
    with open(os.path.join(args.out, f"pool_memory_{args.peer.replace('+', '_')}.json"), "w") as f:
        json.dump({"peer": args.peer, "job": args.job, "device": torch.cuda.get_device_name(), "pools": pools,
                   **peak}, f, indent=1)
    print(f"\n{args.peer} {args.job}, {torch.cuda.get_device_name()}")
    print(f"{'pool':>16s} {'segments':>8s} {'reserved MB':>12s} {'allocated MB':>13s} {'largest free MB':>16s}")
    for pid, v in sorted(pools.items(), key=lambda kv: -kv[1]["reserved_mb"]):
        print(f"{pid:>16s} {v['segments']:8d} {v['reserved_mb']:12.1f} {v['allocated_mb']:13.1f} "
              f"{v['largest_free_mb']:16.1f}")
    print(f"max reserved {peak['max_reserved_gb']:.3f} GB, max allocated {peak['max_allocated_gb']:.3f} GB")


if __name__ == "__main__":
    main()
