"""Host cost per call of the training ops (GPU machine): where a host-bound training step spends its time.

Entry point: `python bench/host_ops.py`. On tiny tensors (device time negligible) it times, per call, the
ATen ops a fused op replaces and the fused op itself, and the pieces of the fused op's path: the custom-op
dispatch, the tuner lookup, and a bare Triton launch. Prints one table (microseconds per call).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse  # noqa: E402,F401  (registers the ops)
from resfuse import kernels  # noqa: E402
from resfuse.ops.fused import Output  # noqa: E402
from resfuse.ops.training import batch_norm_impl, conv2d_dgrad_impl  # noqa: E402
from resfuse.tuning import choose  # noqa: E402

aten = torch.ops.aten


def per_call_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    dev = "cuda"
    cl = torch.channels_last
    x = torch.randn(2, 64, 8, 8, device=dev, dtype=torch.float16).to(memory_format=cl)
    res = torch.randn_like(x)
    w, b = torch.ones(64, device=dev), torch.zeros(64, device=dev)
    rm, rv = torch.zeros(64, device=dev), torch.ones(64, device=dev)
    g = torch.randn(2, 64, 8, 8, device=dev, dtype=torch.float16).to(memory_format=cl)
    wt = torch.randn(64, 64, 1, 1, device=dev, dtype=torch.float16).to(memory_format=cl)
    relu_out = torch.randn_like(x).relu()
    sig_bn, sig_dg = "relu(add(acc,full0))", "threshold_bwd[#0.0](add(full0,acc),full1)"
    grad_in = torch.empty_like(x)
    call = choose.Call("conv2d_dgrad", (g, wt), [res, relu_out], sig_dg, ([1, 1], [0, 0], [1, 1]),
                       Output.like(grad_in))
    choose.configure("fast", str(Path.home() / ".cache" / "resfuse"), 60.0)
    rows = {
        "aten bn + add + relu": lambda: torch.relu(
            aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5)[0] + res),
        "resfuse::batch_norm (triton, 3 launches)": lambda: torch.ops.resfuse.batch_norm(
            x, w, b, rm, rv, [res], sig_bn, 0.1, 1e-5, "triton"),
        "kernels.batch_norm_train (no op dispatch)": lambda: kernels.batch_norm_train(
            x, w, b, rm, rv, [res], sig_bn, 0.1, 1e-5),
        "aten dgrad + add + threshold_backward": lambda: aten.threshold_backward(
            aten.convolution_backward(g, x, wt, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                      [True, False, False])[0] + res, relu_out, 0),
        "resfuse::conv2d_dgrad (tuned choice)": lambda: torch.ops.resfuse.conv2d_dgrad(
            g, wt, [res, relu_out], sig_dg, list(x.shape), [1, 1], [0, 0], [1, 1], "triton"),
        "conv2d_dgrad_impl (what the lowered graph calls)": lambda: conv2d_dgrad_impl(
            g, wt, [res, relu_out], sig_dg, list(x.shape), [1, 1], [0, 0], [1, 1], "triton"),
        "batch_norm_impl (what the lowered graph calls)": lambda: batch_norm_impl(
            x, w, b, rm, rv, [res], sig_bn, 0.1, 1e-5, "triton"),
        "kernels.conv2d_dgrad (triton, no dispatch)": lambda: kernels.conv2d_dgrad(
            g, wt, [res, relu_out], sig_dg, [1, 1], [0, 0], [1, 1], grad_in),
        "kernels.epilogue alone (1 launch)": lambda: kernels.epilogue(x, [res, relu_out], sig_dg, grad_in, 1),
        "choose() lookup": lambda: choose.choose(call),
        "aten add (1 launch)": lambda: x + res,
    }
    print(f"{'path':45s} {'us/call':>8s}")
    for name, fn in rows.items():
        print(f"{name:45s} {per_call_us(fn):8.1f}", flush=True)


if __name__ == "__main__":
    main()
