"""Every candidate of the tuner on ResNet-50's 1x1 data gradients (issue 6), timed with its epilogue.

Entry point: `python bench/dgrad_1x1.py [--batch 256] [--out DIR]`, on a GPU machine.
The training backward runs each 1x1 stride-1 conv's data gradient as one fused op: a block's first conv with
the skip gradient's add and relu's backward (`threshold_bwd(add(acc, full0), full1)`), a block's last conv with
relu's backward (`threshold_bwd(acc, full0)`). For each such shape (channels_last fp16) this times, in a CUDA
graph as the tuner does, every candidate the "fast" level offers: the GEMM TMA and persistent configs (the 1x1
dgrad as grad_out [N*H*W, K] @ W [K, C]), our implicit-GEMM dgrad at the same tiles (what "fast" offered before),
cuDNN's dgrad + our epilogue kernel, and ATen's unfused ops. Prints the best of each kind per shape and the
per-step total (each shape times its count in the net); every candidate's time goes to DIR/dgrad_1x1.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from resfuse import providers  # noqa: E402
from resfuse.ops.fused import Output  # noqa: E402
from resfuse.tuning import choose, space  # noqa: E402

SKIP_DRELU = "threshold_bwd[#0.0](add(acc,full0),full1)"
DRELU = "threshold_bwd[#0.0](acc,full0)"


def resnet50_1x1_dgrads():
    """(grad_input channels C, grad_out channels K, size, epilogue, count per step) of ResNet-50's 1x1 stride-1
    data gradients; a layer's first block has the stride on its 3x3 conv, so its first 1x1 runs at the input's
    size, and its stride-2 downsample (layers 2-4) is no plain GEMM."""
    rows = collections.Counter()
    c_in = 64
    for planes, blocks, size in ((64, 3, 56), (128, 4, 28), (256, 6, 14), (512, 3, 7)):
        for b in range(blocks):
            first_size = size * 2 if (b == 0 and planes > 64) else size
            rows[(c_in, planes, first_size, SKIP_DRELU)] += 1  # conv1: + the skip's (or downsample's) gradient
            rows[(planes, 4 * planes, size, DRELU)] += 1  # conv3, against relu(bn2)'s output
            c_in = 4 * planes
    return rows


def implicit_twins(call) -> list:
    """The implicit-GEMM configs "fast" offered before the TMA ones replaced them (the same tiles)."""
    tma_readable = space._tma_readable
    space._tma_readable = lambda call: False
    try:
        return [c for c in providers.candidates(call, "fast", ("triton",)) if not c.config.get("tma")][1:]
    finally:
        space._tma_readable = tma_readable


def kind(c) -> str:
    if c.provider != "triton":
        return c.provider
    cfg = c.config
    return "persistent" if cfg.get("persistent") else "tma" if cfg.get("tma") else "implicit"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev, cl, f16 = "cuda", torch.channels_last, torch.float16
    rows, totals = [], collections.Counter()
    for (c, k, hw, sig, count) in ((*key, n) for key, n in resnet50_1x1_dgrads().items()):
        g = torch.randn(args.batch, k, hw, hw, device=dev, dtype=f16).contiguous(memory_format=cl)
        w = (torch.randn(k, c, 1, 1, device=dev) / k ** 0.5).to(f16).contiguous(memory_format=cl)
        shape = (args.batch, c, hw, hw)
        ops = [torch.randn(shape, device=dev, dtype=f16).contiguous(memory_format=cl)
               for _ in range(sig.count("full"))]
        ops[-1] = ops[-1].relu()  # relu's output: the mask
        call = choose.Call("conv2d_dgrad", (g, w), ops, sig, ([1, 1], [0, 0], [1, 1]),
                           Output.of(list(shape), f16, g.device, cl))
        cands = providers.candidates(call, "fast") + implicit_twins(call)
        choose.compile_in_parallel(cands, g.device)
        best = {}
        for cand in cands:
            try:
                t = choose._bench(cand.run) * 1e6
            except Exception as e:  # noqa: BLE001  (a config that does not build is reported, not fatal)
                print(f"  {cand.name}: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append(dict(c=c, k=k, hw=hw, signature=sig, count=count, candidate=cand.name, kind=kind(cand),
                             us=t))
            best[kind(cand)] = min(best.get(kind(cand), float("inf")), t)
        line = "  ".join(f"{name} {t:7.1f}" for name, t in sorted(best.items()))
        print(f"C={c:4d} K={k:4d} {hw:3d}x{hw:<3d} x{count} {'skip+drelu' if 'add' in sig else 'drelu':10s} {line}",
              flush=True)
        for name, t in best.items():
            totals[name] += t * count
        totals["old best (implicit, epilogue)"] += min(best.get("implicit", 1e9), best.get("epilogue", 1e9)) * count
        totals["new best"] += min(best.values()) * count
    json.dump(rows, open(os.path.join(args.out, "dgrad_1x1.json"), "w"), indent=1)
    print(f"\nper step (bs{args.batch}), us:")
    for name, t in totals.items():
        print(f"  {name:32s} {t:9.1f}")


if __name__ == "__main__":
    main()
