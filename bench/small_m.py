"""GPU probe: ResNet-50's layer-3/4 convs at batch 1, where each grid has a handful of output tiles. cuDNN's conv
alone against our conv kernel (no epilogue) at wider split-K factors than the heuristic's (it keeps 4 reduction
blocks a split, matmul.split_k_heuristic), to see whether splitting the reduction further pays at this size.

  python bench/small_m.py [--batch 1] [--out DIR]

fp16 channels_last; each variant checked against the fp32 conv, timed by CUDA-graph replay (the tuner's timer), us;
rows printed as measured, all in DIR/small_m.json.
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
from resfuse.tuning.choose import _bench  # noqa: E402

# (name, C, K, side, filter, stride): layer 4's 3x3 and 1x1 2048>512, layer 3's 3x3
CASES = [("l4 3x3 512", 512, 512, 7, 3, 1), ("l4 1x1 2048>512", 2048, 512, 7, 1, 1), ("l3 3x3 256", 256, 256, 14, 3, 1)]
CONFIGS = [(bm, bn, split) for bm, bn in ((64, 64), (32, 64), (64, 128)) for split in (1, 4, 8, 16, 32)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    rows = []
    for name, c, k, side, r, stride in CASES:
        cl = torch.channels_last
        x = torch.randn(args.batch, c, side, side, device="cuda").half().contiguous(memory_format=cl)
        w = (torch.randn(k, c, r, r, device="cuda") / (c * r * r) ** 0.5).half().contiguous(memory_format=cl)
        pad = r // 2
        ref = F.conv2d(x.float(), w.float(), None, stride, pad)
        out = torch.empty(ref.shape, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
        rows.append({"case": name, "variant": "cudnn", "us": _bench(lambda: F.conv2d(x, w, None, stride, pad)) * 1e6})
        print(rows[-1], flush=True)
        for bm, bn, split in CONFIGS:
            cfg = ConvConfig(bm, bn, 64, 8, split, False, 4, 3, tma=r == 1)
            def run(cfg=cfg):
                kernels.conv2d(x, w, [], "acc", [stride] * 2, [pad] * 2, [1, 1], out, cfg)
            try:
                out.fill_(float("nan"))
                run()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                rows.append({"case": name, "variant": f"ours {bm}x{bn} split {split}", "us": _bench(run) * 1e6,
                             "rel_err": err})
            except Exception as e:  # noqa: BLE001 - a config that fails is a row
                rows.append({"case": name, "variant": f"ours {bm}x{bn} split {split}", "error": str(e)[:200]})
            print(rows[-1], flush=True)
        with open(os.path.join(args.out, "small_m.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
