"""Shared memory of the chain kernel (kernels/chain.py) per config, compiled for sm_90 on this machine (no GPU).

  python bench/chain_smem.py [--pairs 64>256>64,128>512>128] [--configs 128x2,128x1,64x2,64x1]

For each pair of 1x1 convs (x's channels > y's > z's, a bottleneck's tail with batch norm, residual and relu, then
the next head with batch norm and relu) and each config (BN1 x stages), it records the launch the op would make
(tuning/precompile.record) under a fake Hopper driver (bench/fake_hopper.py), compiles
it with Triton and prints the bytes of shared memory the kernel takes (an H100 block gets at most 232,448). A pair
the kernel refuses prints the refusal.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import fake_hopper  # noqa: E402

fake_hopper.install()

from resfuse.kernels import chain  # noqa: E402
from resfuse.ops import chain as chain_op  # noqa: E402
from resfuse.tuning import precompile, workers  # noqa: E402
TAIL, HEAD = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))", "relu(bn[#1e-05](acc,c0,c1,c2,c3))"


def nhwc(*shape):
    t = torch.randn(*shape, dtype=torch.half)
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def shared_bytes(k1: int, n1: int, n2: int, cfg: chain.ChainConfig) -> int:
    bn = lambda c: [nhwc(c) for _ in range(4)]  # noqa: E731
    call = chain_op.call_of(nhwc(2, k1, 8, 8), nhwc(n1, k1, 1, 1), [*bn(n1), nhwc(2, n1, 8, 8)], TAIL,
                            nhwc(n2, n1, 1, 1), bn(n2), HEAD)
    (spec,) = precompile.record([lambda: chain_op.run_chain(call, cfg)])
    return workers.compiled(spec).metadata.shared


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", default="64>256>64,64>256>128,128>512>128,128>256>128,256>512>256")
    p.add_argument("--configs", default="128x2,128x1,64x2,64x1", help="BN1 x stages")
    args = p.parse_args()
    print(f"{'pair':16s} {'BN1':>4s} {'stages':>6s} {'bytes':>9s}")
    for pair in args.pairs.split(","):
        k1, n1, n2 = map(int, pair.split(">"))
        why = chain.refusal(nhwc(2, k1, 8, 8), nhwc(n1, k1, 1, 1), nhwc(n2, n1, 1, 1))
        if why:
            print(f"{pair:16s} refused: {why}")
            continue
        for item in args.configs.split(","):
            bn1, stages = map(int, item.split("x"))
            taken = shared_bytes(k1, n1, n2, chain.ChainConfig(block_n1=bn1, num_stages=stages))
            print(f"{pair:16s} {bn1:4d} {stages:6d} {taken:9d}", flush=True)


if __name__ == "__main__":
    main()
