"""GPU benchmark of the max-pool kernels on ResNet-50's stem pool (3x3, stride 2, padding 1 over the stem's
relu output, channels_last).

Entry point: `python bench/pool_kernels.py [--batch 32 256] [--dtype fp16] [--sweep | --epilogue-sweep]
[--out DIR]`, on a GPU machine. For each batch:
  forward:            ours with ATen's indices, with int8 window codes (training) and without indices
                      (inference) against ATen's max_pool2d_with_indices and torch.compile's kernel;
  backward (+ drelu): ours, relu's gradient applied on the way out (from the mask, or from the window codes'
                      flag), against ATen's pool backward followed by threshold_backward, and torch.compile's
                      fused backward;
  inference's stem:   ours with the conv's batch norm + relu evaluated at each window's extremes
                      (max_pool2d_epilogue), against the fp32 reference; --epilogue-sweep times its tiles alone.
Numerics first (values and indices equal ATen's; backward against ATen in fp32). Times: each call replayed in a
CUDA graph (triton's do_bench_cudagraph), median. The bandwidth column is the minimal bytes over the time.
Prints a table; the rows go to DIR/pool_kernels.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402
from resfuse.kernels import max_pool  # noqa: E402
from resfuse.ops.pooling import aten_indices  # noqa: E402

aten = torch.ops.aten
ARGS = ([3, 3], [2, 2], [1, 1], [1, 1], False)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=50) * 1e3  # us


def one_batch(batch: int, dtype: torch.dtype) -> list[dict]:
    x = torch.randn(batch, 64, 112, 112, device="cuda", dtype=dtype).relu().contiguous(
        memory_format=torch.channels_last)
    out, idx = aten.max_pool2d_with_indices(x, *ARGS)
    g = torch.randn_like(out)
    ours_out, ours_idx = torch.empty_like(out), torch.empty_like(idx)
    kernels.max_pool2d(x, *ARGS[:4], ours_out, ours_idx)
    assert torch.equal(ours_out, out) and torch.equal(ours_idx, idx), "forward differs from ATen's"
    ref = aten.threshold_backward(aten.max_pool2d_with_indices_backward(g.float(), x.float(), *ARGS, idx), x.float(), 0)
    dx = torch.empty_like(x)
    kernels.max_pool2d_backward(g, idx, *ARGS[:4], dx, x, 0.0)
    err = ((dx.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"backward relative error {err}"
    codes = torch.empty_like(idx, dtype=torch.int8)
    kernels.max_pool2d(x, *ARGS[:4], ours_out, codes)
    assert torch.equal(ours_out, out) and torch.equal(aten_indices(codes, x.shape[3], *ARGS[:4]), idx), \
        "window codes differ from ATen's indices"
    dx_codes = torch.empty_like(x)
    kernels.max_pool2d_backward(g, codes, *ARGS[:4], dx_codes, x, 0.0, True)
    assert torch.equal(dx_codes, dx), "the backward from window codes differs from the one from ATen's indices"

    def compiled_fwd(t):
        return torch.nn.functional.max_pool2d(t, 3, 2, 1, return_indices=True)

    def compiled_bwd(t, grad):
        return torch.ops.aten.threshold_backward(
            aten.max_pool2d_with_indices_backward(grad, t, *ARGS, aten.max_pool2d_with_indices(t, *ARGS)[1]), t, 0)

    fwd_c, bwd_c = torch.compile(compiled_fwd), torch.compile(compiled_bwd)
    fwd_c(x), bwd_c(x, g)
    x_b, o_b, i_b = x.numel() * x.element_size(), out.numel() * out.element_size(), idx.numel() * 8
    rows = []

    def row(name, fn, nbytes):
        us = bench(fn)
        rows.append({"batch": batch, "case": name, "us": us, "GB/s": nbytes / us / 1e3})

    row("forward + indices: ours", lambda: kernels.max_pool2d(x, *ARGS[:4], ours_out, ours_idx), x_b + o_b + i_b)
    row("forward + indices: aten", lambda: aten.max_pool2d_with_indices(x, *ARGS), x_b + o_b + i_b)
    row("forward + indices: torch.compile", lambda: fwd_c(x), x_b + o_b + i_b)
    row("forward + window codes: ours", lambda: kernels.max_pool2d(x, *ARGS[:4], ours_out, codes),
        x_b + o_b + codes.numel())
    row("forward (inference): ours", lambda: kernels.max_pool2d(x, *ARGS[:4], ours_out), x_b + o_b)
    row("backward + drelu: ours", lambda: kernels.max_pool2d_backward(g, idx, *ARGS[:4], dx, x, 0.0),
        o_b + i_b + 2 * x_b)
    row("backward + drelu, window codes: ours",
        lambda: kernels.max_pool2d_backward(g, codes, *ARGS[:4], dx_codes, x, 0.0, True), o_b + codes.numel() + x_b)
    row("backward + drelu: aten", lambda: aten.threshold_backward(
        aten.max_pool2d_with_indices_backward(g, x, *ARGS, idx), x, 0), o_b + i_b + 2 * x_b)
    row("backward + drelu: torch.compile (recomputes the indices)", lambda: bwd_c(x, g), o_b + 2 * x_b)
    # inference's stem: the pool evaluates the conv's batch norm + relu at each window's extremes
    stem_ops = [torch.randn(64, device="cuda", dtype=dtype), torch.rand(64, device="cuda", dtype=dtype) + 0.5,
                torch.randn(64, device="cuda", dtype=dtype), torch.randn(64, device="cuda", dtype=dtype)]
    acc = torch.randn_like(x)
    stem_ref = aten.max_pool2d_with_indices(torch.relu(torch.nn.functional.batch_norm(
        acc.float(), *[t.float() for t in stem_ops], False, 0.0, 1e-5)), *ARGS)[0]
    stem_out = torch.full_like(out, float("nan"))
    max_pool.max_pool2d_epilogue(acc, stem_ops, STEM, *ARGS[:4], stem_out)
    err = ((stem_out.float() - stem_ref).norm() / stem_ref.norm()).item()
    assert err < 1e-3, f"pool epilogue relative error {err}"
    row("forward of bn + relu (inference stem): ours",
        lambda: max_pool.max_pool2d_epilogue(acc, stem_ops, STEM, *ARGS[:4], stem_out), x_b + o_b)
    if SWEEP:
        for tile in [(bm, bc, w) for bc in (32, 64) for bm in (8, 16, 32, 64) for w in (1, 2, 4, 8)]:
            row(f"sweep fwd bn+relu {tile}", lambda: max_pool.max_pool2d_epilogue(
                acc, stem_ops, STEM, *ARGS[:4], stem_out, tile=tile), x_b + o_b)
    if SWEEP and not EPILOGUE_ONLY:
        c_b = codes.numel()
        row("backward, no drelu: ours", lambda: kernels.max_pool2d_backward(g, idx, *ARGS[:4], dx), o_b + i_b + x_b)
        row("backward, no drelu, window codes: ours", lambda: kernels.max_pool2d_backward(g, codes, *ARGS[:4], dx),
            o_b + c_b + x_b)
        row("backward + drelu from the mask, window codes: ours",
            lambda: kernels.max_pool2d_backward(g, codes, *ARGS[:4], dx, x, 0.0), o_b + c_b + 2 * x_b)
        unflagged = codes & 63
        row("backward + drelu, window codes, no flags set: ours",
            lambda: kernels.max_pool2d_backward(g, unflagged, *ARGS[:4], dx, x, 0.0, True), o_b + c_b + x_b)
        row("backward + drelu, window codes (again): ours",
            lambda: kernels.max_pool2d_backward(g, codes, *ARGS[:4], dx, x, 0.0, True), o_b + c_b + x_b)
        row("backward, no drelu, window codes (again): ours", lambda: kernels.max_pool2d_backward(g, codes, *ARGS[:4], dx),
            o_b + c_b + x_b)
        codes16 = codes.to(torch.int16)
        row("forward + int16 window codes: ours", lambda: kernels.max_pool2d(x, *ARGS[:4], ours_out, codes16),
            x_b + o_b + 2 * c_b)
        row("backward + drelu, int16 window codes: ours",
            lambda: kernels.max_pool2d_backward(g, codes16, *ARGS[:4], dx, x, 0.0, True), o_b + 2 * c_b + x_b)
        for tile in [(bm, bc, w) for bc in (32, 64) for bm in (16, 32, 64, 128) for w in (2, 4, 8)]:
            row(f"sweep bwd codes {tile}", lambda: max_pool.max_pool2d_backward(g, codes, *ARGS[:4], dx, x, 0.0, True,
                                                                                tile=tile), o_b + c_b + x_b)
        for tile in [(bm, bc, w) for bc in (32, 64) for bm in (16, 32, 64, 128) for w in (2, 4, 8)]:
            row(f"sweep fwd+idx {tile}", lambda: max_pool.max_pool2d(x, *ARGS[:4], ours_out, ours_idx, tile=tile),
                x_b + o_b + i_b)
            row(f"sweep fwd {tile}", lambda: max_pool.max_pool2d(x, *ARGS[:4], ours_out, None, tile=tile), x_b + o_b)
            row(f"sweep bwd {tile}", lambda: max_pool.max_pool2d_backward(g, idx, *ARGS[:4], dx, x, 0.0, tile=tile),
                o_b + i_b + 2 * x_b)
    return rows


SWEEP = False
EPILOGUE_ONLY = False
STEM = "relu(bn[#1e-05](acc,c0,c1,c2,c3))"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    p.add_argument("--dtype", default="fp16", choices=DTYPES)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--sweep", action="store_true", help="also time a grid of tiles (BM, BC, warps)")
    p.add_argument("--epilogue-sweep", action="store_true", help="sweep the tiles of the bn + relu pool only")
    args = p.parse_args()
    global SWEEP, EPILOGUE_ONLY
    SWEEP = args.sweep or args.epilogue_sweep
    EPILOGUE_ONLY = args.epilogue_sweep
    os.makedirs(args.out, exist_ok=True)
    rows = [r for b in args.batch for r in one_batch(b, DTYPES[args.dtype])]
    with open(os.path.join(args.out, "pool_kernels.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "rows": rows}, f, indent=1)
    print(f"ResNet-50 stem max-pool, {args.dtype} channels_last, on {torch.cuda.get_device_name()}")
    for r in rows:
        print(f"bs{r['batch']:<4} {r['case']:58s} {r['us']:9.1f} us {r['GB/s']:8.0f} GB/s")


if __name__ == "__main__":
    main()
