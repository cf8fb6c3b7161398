"""GPU probe: ResNet-50's layer-3/4 convs at batch 1, where each grid has a handful of output tiles. cuDNN's conv
alone against our conv kernel (no epilogue) at wider split-K factors than the heuristic's (it keeps 4 reduction
blocks a split, matmul.split_k_heuristic), to see whether splitting the reduction further pays at this size.

  python bench/small_m.py [--batch 1] [--cases "l4 3x3 512,..."] [--tiles 64x64,32x64,64x128] [--splits 1,4,8,16,32]
                          [--tma] [--stages 1,2,3] [--warps 4,8] [--zeroed-tickets] [--out DIR]

At batch 32 the same question for the 3x3 convs whose 128x128 tiles under-fill the 132 SMs (layers 3 and 4), and
layer 1's 3x3 conv for scale: `--batch 32 --tiles 128x128,128x64,64x128,64x64 --splits 1,2,4,8 --tma` (the box
mainloop, as the tuner offers it for a stride-1 3x3 conv).

fp16 channels_last; each variant checked against the fp32 conv, timed by CUDA-graph replay (the tuner's timer), us;
rows printed as measured, all in DIR/small_m.json. Each variant's error is the larger of a check before and one
after its timed replays.

--cold also times each variant with its weights out of L2, as in a model whose weights outgrow L2 (ResNet-50's fp16
weights are 51 MB, an H100's L2 50 MB): one graph calls it on a rotation of weight copies that together span three
times the L2 (at most 400), the input the same in every call, as a model's previous kernel leaves it in L2. The
tuner's timer keeps one weight in L2 (BENCHMARKS.md, forty-second session).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402
from resfuse.kernels.conv2d_fprop import ConvConfig  # noqa: E402
from resfuse.tuning.choose import _bench, _replay_s  # noqa: E402

L2_BYTES = 50 * 2**20  # an H100's


def cold_bench(run, w, retries: int = 5) -> tuple[float, int]:
    """(seconds a call of run(weight), the copies used): one CUDA graph calls it once on each of enough copies of
    `w` to span three L2s, so every call finds its weight in DRAM; the median of `retries` replays."""
    from resfuse.kernels.split_k import graph_tickets

    copies = [w.clone(memory_format=torch.preserve_format) for _ in range(min(400, max(2, 3 * L2_BYTES // (
        w.numel() * w.element_size()) + 1)))]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run(copies[0])  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with graph_tickets(stream.device), torch.cuda.graph(graph):
            for c in copies:
                run(c)
        times = sorted(_replay_s(graph, 1) / len(copies) for _ in range(retries))
    return times[len(times) // 2], len(copies)

# (name, C, K, side, filter, stride): layer 4's 3x3 and 1x1 2048>512, layer 3's, layer 2's and layer 1's 3x3, and
# the other 1x1 convs of layers 2-4
CASES = [("l4 3x3 512", 512, 512, 7, 3, 1), ("l4 1x1 2048>512", 2048, 512, 7, 1, 1), ("l3 3x3 256", 256, 256, 14, 3, 1),
         ("l2 3x3 128", 128, 128, 28, 3, 1), ("l1 3x3 64", 64, 64, 56, 3, 1),
         ("l4 1x1 512>2048", 512, 2048, 7, 1, 1), ("l3 1x1 1024>256", 1024, 256, 14, 1, 1),
         ("l3 1x1 256>1024", 256, 1024, 14, 1, 1), ("l2 1x1 512>128", 512, 128, 28, 1, 1)]


def zeroed_tickets():
    """Split launches as before the thirty-fourth session: each zeroes a fresh ticket buffer, a kernel of its own
    (kernels/split_k.py now keeps a zeroed buffer per stream and per captured graph)."""
    from resfuse.kernels import split_k

    split_k._kept = lambda device: None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cases", default="l4 3x3 512,l4 1x1 2048>512,l3 3x3 256")
    p.add_argument("--tiles", default="64x64,32x64,64x128")
    p.add_argument("--splits", default="1,4,8,16,32")
    p.add_argument("--tma", action="store_true", help="TMA mainloops (tiles of 4 or 8 warps by size)")
    p.add_argument("--stages", help="comma list of num_stages to sweep (default: by tile size)")
    p.add_argument("--warps", help="comma list of num_warps to sweep (default: by tile size)")
    p.add_argument("--zeroed-tickets", action="store_true",
                   help="each split launch zeroes a fresh ticket buffer, as before kept tickets (split_k.py): "
                        "what that launch costs")
    p.add_argument("--cold", action="store_true", help="also time each variant with its weights out of L2")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.zeroed_tickets:
        zeroed_tickets()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    def ints(text):
        return [int(v) for v in text.split(",")] if text else [None]
    configs = [(bm, bn, split, stages, warps) for bm, bn in tiles for split in ints(args.splits)
               for stages in ints(args.stages) for warps in ints(args.warps)]
    cases = [c for c in CASES if c[0] in args.cases.split(",")]
    torch.backends.cudnn.benchmark = True
    rows = []
    for name, c, k, side, r, stride in cases:
        cl = torch.channels_last
        x = torch.randn(args.batch, c, side, side, device="cuda").half().contiguous(memory_format=cl)
        w = (torch.randn(k, c, r, r, device="cuda") / (c * r * r) ** 0.5).half().contiguous(memory_format=cl)
        pad = r // 2
        ref = F.conv2d(x.float(), w.float(), None, stride, pad)
        out = torch.empty(ref.shape, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        rows.append({"case": name, "variant": "cudnn", "batch": args.batch,
                     "us": _bench(lambda: F.conv2d(x, w, None, stride, pad)) * 1e6})
        if args.cold:
            cold_s, copies = cold_bench(lambda wc: F.conv2d(x, wc, None, stride, pad), w)
            rows[-1].update(cold_us=cold_s * 1e6, copies=copies)
        print(rows[-1], flush=True)
        for bm, bn, split, stages, warps in configs:
            big = bm * bn >= 128 * 128
            cfg = ConvConfig(bm, bn, 64, 8, split, False, warps or (8 if big and args.tma else 4),
                             stages or (3 if big or not args.tma else 4), tma=args.tma or r == 1)
            label = f"ours {bm}x{bn} split {split} stages {cfg.num_stages} warps {cfg.num_warps}"

            def run(cfg=cfg, w=w):
                kernels.conv2d(x, w, [], "acc", [stride] * 2, [pad] * 2, [1, 1], out, cfg)
            try:
                out.fill_(float("nan"))
                run()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = _bench(run) * 1e6
                out.fill_(float("nan"))  # checked again after the timed replays: kept tickets must be back at 0
                run()
                again = ((out.float() - ref).norm() / ref.norm()).item()
                rows.append({"case": name, "variant": label, "us": us, "rel_err": max(err, again)})
                if args.cold:
                    cold_s, copies = cold_bench(lambda wc, cfg=cfg: run(cfg, wc), w)
                    rows[-1].update(cold_us=cold_s * 1e6, copies=copies)
            except Exception as e:  # noqa: BLE001 - a config that fails is a row
                rows.append({"case": name, "variant": label, "error": str(e)[:200]})
            print(rows[-1], flush=True)
        with open(os.path.join(args.out, "small_m.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
