"""Find the launch that faults while resfuse tunes a Llama (GPU): every candidate launched alone, in order, each
announced before it runs, with CUDA_LAUNCH_BLOCKING=1, so the last line printed names the faulting one.

  CUDA_LAUNCH_BLOCKING=1 python bench/llama_debug.py [--layers 2] [--batch 8] [--seq 384] [--no-glu]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402
from resfuse.bench import models  # noqa: E402
from resfuse.providers import triton as triton_provider  # noqa: E402
from resfuse.tuning import choose  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=384)
    p.add_argument("--no-glu", action="store_true")
    args = p.parse_args()
    torch.manual_seed(models.SEED)
    model = models.llama(args.layers).eval().cuda().half()
    ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda")
    launch = triton_provider._launch

    def announced(call, signature, operands, out, config, aux=None, stats=None):
        shapes = [tuple(t.shape) for t in call.inputs]
        print(f"launch {call.op} {shapes} -> {tuple(out.shape)} {signature} {config}", flush=True)
        return launch(call, signature, operands, out, config, aux, stats)

    triton_provider._launch = announced
    choose.compile_in_parallel = lambda candidates, device: None  # one at a time, in select's order
    with torch.no_grad():
        ref = model(ids).float()
        out = resfuse.compile(model, fuse_glu=not args.no_glu)(ids).float()
    print("rel err", ((out - ref).norm() / ref.norm()).item())


if __name__ == "__main__":
    main()
