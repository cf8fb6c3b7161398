"""The cudnn provider on ResNet-50 layers (GPU machine, nvidia-cudnn-frontend installed): numerics and time.

Entry point: `python bench/cudnn_check.py [--batch 32] [--forms bn,scale_bias,bias]`. For each layer (fp16,
channels_last, the epilogues resfuse fuses there) it builds the cuDNN graph, checks its output against the fp32
unfused reference, and times it beside the aten (unfused) and epilogue (cuDNN conv + our epilogue kernel)
providers and the bare conv with CUDA-graph replay. Prints one table per form of the batch norm: `bn` as resfuse
writes it, (x - mean) * rsqrt(var + eps) * weight + bias; `scale_bias`, the same folded into two per-channel
vectors, x * scale + shift (cuDNN's ConvScaleBiasAct pattern); `bias`, a shift alone (ConvBiasAct, weights
folded). A layer cuDNN cannot fuse says why.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from resfuse.ops.fused import Output  # noqa: E402
from resfuse.providers import aten, cudnn, epilogue  # noqa: E402
from resfuse.tuning import choose  # noqa: E402

BN_RELU = "relu(bn[#1e-05](acc,c0,c1,c2,c3))"
BN_ADD_RELU = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))"
FORMS = {  # form -> (signature without and with the residual)
    "bn": (BN_RELU, BN_ADD_RELU),
    "scale_bias": ("relu(add(mul(acc,c0),c1))", "relu(add(add(mul(acc,c0),c1),full2))"),
    "bias": ("relu(add(acc,c0))", "relu(add(add(acc,c0),full1))"),
}
LAYERS = [  # name, C, K, R, stride, pad, H, signature
    ("l1 1x1 64>256 tail", 64, 256, 1, 1, 0, 56, BN_ADD_RELU),
    ("l1 3x3 64>64", 64, 64, 3, 1, 1, 56, BN_RELU),
    ("l1 1x1 256>64", 256, 64, 1, 1, 0, 56, BN_RELU),
    ("l2 3x3 128 s2", 128, 128, 3, 2, 1, 56, BN_RELU),
    ("l3 3x3 256>256", 256, 256, 3, 1, 1, 14, BN_RELU),
    ("l3 1x1 256>1024 tail", 256, 1024, 1, 1, 0, 14, BN_ADD_RELU),
    ("l4 3x3 512>512", 512, 512, 3, 1, 1, 7, BN_RELU),
    ("stem 7x7 3>64 s2", 3, 64, 7, 2, 3, 224, BN_RELU),
]


def make_call(batch, c, k, r, stride, pad, h, sig):
    cl = torch.channels_last
    dev, dt = "cuda", torch.float16
    x = torch.randn(batch, c, h, h, device=dev, dtype=dt).to(memory_format=cl)
    w = (torch.randn(k, c, r, r, device=dev, dtype=dt) / (c * r * r) ** 0.5).to(memory_format=cl)
    oh = (h + 2 * pad - r) // stride + 1
    vecs = [torch.randn(k, device=dev, dtype=dt), torch.rand(k, device=dev, dtype=dt) + 0.5,
            torch.randn(k, device=dev, dtype=dt), torch.randn(k, device=dev, dtype=dt)]
    vecs = vecs[:sum(f"c{i}" in sig for i in range(4))]
    ops = vecs + ([torch.randn(batch, k, oh, oh, device=dev, dtype=dt).to(memory_format=cl)] if "full" in sig else [])
    out = Output.of([batch, k, oh, oh], dt, x.device, cl)
    return choose.Call("conv2d", (x, w), ops, sig, ([stride, stride], [pad, pad], [1, 1]), out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--forms", default="bn")
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    for form in args.forms.split(","):
        print(f"\nform {form}, batch {args.batch}")
        table(args.batch, FORMS[form])


def table(batch, sigs):
    rows = []
    for name, *shape, sig in LAYERS:
        call = make_call(batch, *shape, sigs[1] if sig == BN_ADD_RELU else sigs[0])
        ref = choose._reference(call)
        x, w = call.inputs
        stride, pad, _ = call.params
        conv_us = choose._bench(lambda: torch.conv2d(x, w, None, stride, pad)) * 1e6
        row = {"layer": name, "conv": f"{conv_us:7.1f} us"}
        for prov, mod in (("aten", aten), ("epilogue", epilogue), ("cudnn", cudnn)):
            why = mod.refusal(call)
            if why:
                row[prov] = why[:60]
                continue
            cands = mod.candidates(call, "fast")
            if not cands:
                row[prov] = "refused (see above)"
                continue
            out = cands[0].run()
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            t = choose._bench(cands[0].run) * 1e6
            row[prov] = f"{t:7.1f} us err {err:.1e}"
        rows.append(row)
        print(row, flush=True)
    print(f"\n{'layer':22s} {'conv alone':>12s} {'aten':>24s} {'epilogue':>24s} {'cudnn':>24s}")
    for r in rows:
        print(f"{r['layer']:22s} {r['conv']:>12s} {r.get('aten', ''):>24s} {r.get('epilogue', ''):>24s} "
              f"{r.get('cudnn', ''):>24s}")


if __name__ == "__main__":
    main()
