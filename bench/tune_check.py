"""Tune the BERT GEMM calls that found no correct candidate inside the model, standalone (GPU machine).

Entry point: `python bench/tune_check.py`. Builds each call with the model's shapes and strides from random
data, runs the real two-stage tuning with the real benchmarker, and prints each candidate's output norm
against the reference's, so a wrong reference or a wrong comparison shows itself.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from resfuse.ops.fused import Output  # noqa: E402
from resfuse.tuning import choose, select  # noqa: E402


def call_ffn1():
    a = torch.randn(12288, 768, device="cuda", dtype=torch.float16)
    w = torch.randn(3072, 768, device="cuda", dtype=torch.float16) * 0.02
    bias = torch.zeros(3072, device="cuda", dtype=torch.float16)
    out = Output.of([12288, 3072], torch.float16, a.device)
    return choose.Call("gemm", (a, w.t()), [bias], "gelu(add(acc,c0))", ([12288, 3072],), out)


def call_ffn2():
    a = torch.randn(12288, 3072, device="cuda", dtype=torch.float16).abs()
    w = torch.randn(768, 3072, device="cuda", dtype=torch.float16) * 0.02
    bias = torch.zeros(768, device="cuda", dtype=torch.float16)
    res = torch.randn(32, 384, 768, device="cuda", dtype=torch.float16)
    out = Output.of([32, 384, 768], torch.float16, a.device)
    return choose.Call("gemm", (a, w.t()), [bias, res], "add(add(acc,c0),full1)", ([32, 384, 768],), out)


def main():
    real_wrong = select._wrong

    def wrong(out, reference, tol):
        why = real_wrong(out, reference, tol)
        print(f"    out norm {out.double().norm():.4g} ref norm {reference.double().norm():.4g} "
              f"out shape {tuple(out.shape)} {out.stride()} ref {tuple(reference.shape)} {reference.stride()} -> {why}")
        return why

    select._wrong = wrong
    for make in (call_ffn1, call_ffn2):
        call = make()
        print(f"== {call.signature}")
        entry = choose.tune(call, bench=choose._bench, level="fast")
        print("   entry:", entry)


if __name__ == "__main__":
    main()
