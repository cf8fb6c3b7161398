"""Registers and spills of the stem probe kernel (bench/stem_kernel.py), scratch and gather variants, as Triton
compiled them: on a GPU machine, alone or under Nsight Compute (`ncu --kernel-name regex:resfuse_stem_probe
--launch-count 1 python3 bench/stem_regs.py`, twenty-seventh session).

Entry point: `python bench/stem_regs.py [--batch 32] [--warps 4]`.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse.kernels import codegen  # noqa: E402
from stem_kernel import PoolConfig, conv2d_max_pool  # noqa: E402  (bench/ is sys.path[0])

SIG = "relu(bn[#1e-05](acc,c0,c1,c2,c3))"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--no-gather", action="store_true", help="build the scratch variants only")
    args = parser.parse_args()
    dev = "cuda"
    x = torch.randn(args.batch, 3, 224, 224, device=dev, dtype=torch.float16).contiguous(
        memory_format=torch.channels_last)
    w = torch.randn(64, 3, 7, 7, device=dev).half().contiguous(memory_format=torch.channels_last)
    ops = [torch.rand(64, device=dev).half() + 0.5 for _ in range(4)]
    out = torch.empty(args.batch, 64, 56, 56, device=dev, dtype=torch.float16).contiguous(
        memory_format=torch.channels_last)
    configs = [PoolConfig(num_warps=args.warps, splits=n) for n in args.splits]
    for cfg in configs + ([] if args.no_gather else [PoolConfig(num_warps=args.warps, gather=True)]):
        conv2d_max_pool(x, w, ops, SIG, [2, 2], [3, 3], [1, 1], ([3, 3], [2, 2], [1, 1], [1, 1], False),
                                  out, cfg)
    torch.cuda.synchronize()
    kernel = codegen._LOADED[("stem_probe", SIG)]
    print("in build order:", *configs, "gather", sep="\n  ")
    for cache in kernel.device_caches.values():
        for compiled in cache[0].values():
            compiled._init_handles()
            print("regs", compiled.n_regs, "spills", compiled.n_spills, "shared", compiled.metadata.shared,
                  "warps", compiled.metadata.num_warps, flush=True)


if __name__ == "__main__":
    main()
