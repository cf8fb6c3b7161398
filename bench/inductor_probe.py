"""Which kernels Inductor writes for ResNet's stem (conv, batch norm, relu, max-pool) under torch.compile and as
resfuse's remainder with the stem conv left to Inductor (GPU machine).

Entry point: `TORCH_LOGS=output_code python bench/inductor_probe.py [--batch 32] 2> code.log`: prints each
variant's kernel launches from the profiler, and the generated code goes to the log.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse  # noqa: E402
from resfuse.tuning import choose  # noqa: E402


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.pool = nn.MaxPool2d(3, 2, 1)

    def forward(self, x):
        return self.pool(torch.relu(self.bn(self.conv(x))))


def kernels(fn, x) -> list[tuple[str, float]]:
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    net = Stem().eval().cuda().half().to(memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    untuned = lambda call: choose.UNTUNED  # noqa: E731  (cuDNN + epilogue wins: the conv goes to Inductor)
    with torch.no_grad():
        ref = net(x)
        variants = {"compile": torch.compile(net)}
        real_choose, choose.choose = choose.choose, untuned
        variants["resfuse"] = resfuse.compile(net, cuda_graphs=False)
        for name, fn in variants.items():
            print(f"== {name}: rel err {((fn(x) - ref).float().norm() / ref.float().norm()).item():.1e}", flush=True)
            for k, t in kernels(fn, x):
                print(f"  {t:9.1f} us  {k[:110]}")
        choose.choose = real_choose
        print(variants["resfuse"].resfuse_report.rejected)


if __name__ == "__main__":
    main()
