"""Where resfuse's training step takes its peak memory (GPU machine).

Entry point: `python bench/train_memory.py [--batch 256]`. Wraps every fused op's implementation so that each
call records the memory allocated when it starts and the most it allocates on top while it runs (its
transient: workspaces, temporaries); then runs ResNet-50 training steps with add-to-output on and off, and
prints, per op signature, the largest transient and the allocated level at its call, beside the step's peak.
"""
from __future__ import annotations

import argparse
import collections
import copy
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse  # noqa: E402
from resfuse import ops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import resnet50, step_fn  # noqa: E402

STATS: dict = collections.defaultdict(lambda: [0, 0, 0])  # (op, signature) -> [calls, max transient, max level]


def instrument():
    for target, fn in list(ops.IMPLS.items()):
        def wrapped(*args, _fn=fn, _name=fn.__name__):
            level = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = _fn(*args)
            transient = torch.cuda.max_memory_allocated() - level
            sig = next((a for a in args if isinstance(a, str) and ("(" in a or a == "acc")), "?")
            s = STATS[(_name, sig)]
            s[0] += 1
            s[1], s[2] = max(s[1], transient), max(s[2], level)
            return out
        ops.IMPLS[target] = wrapped


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args()
    instrument()
    torch.manual_seed(0)
    base, data, loss_fn = resnet50(args.batch)
    for ato in (True, False):
        STATS.clear()
        torch._dynamo.reset()
        model = copy.deepcopy(base).train()
        compiled = resfuse.compile(model, fuse_add_to_output=ato)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
        step = step_fn(compiled, opt, loss_fn, data)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        gc.collect()
        STATS.clear()
        before = torch.cuda.memory_allocated()
        peaks = []
        for _ in range(2):
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        print(f"\n== add-to-output {'on' if ato else 'off'}: allocated between steps {before / 1e9:.2f} GB, "
              f"last step's op-level peak {peaks[-1] / 1e9:.2f} GB (reset at every op, so a lower bound)")
        rows = sorted(STATS.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:15]
        print(f"{'op':22s} {'calls':>5s} {'transient GB':>12s} {'level GB':>9s}  signature")
        for (name, sig), (calls, transient, level) in rows:
            print(f"{name:22s} {calls:5d} {transient / 1e9:12.3f} {level / 1e9:9.2f}  {sig}")
        del compiled, model, opt, step
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
