"""GPU benchmark of the training batch-norm kernels (issue 6) on every batch-norm shape of ResNet-50.

Entry point: `python bench/bn_kernels.py [--batch 256] [--dtype fp16] [--sweep] [--out DIR]`, on a GPU machine.
For each distinct [N, C, H, W] (channels_last) of torchvision's ResNet-50 at the batch, with how often it occurs:
  forward:  ours (kernels.batch_norm_train with a relu epilogue) against aten's functional batch norm + relu
            and cuDNN's batch norm + relu (what eager runs);
  backward: ours (kernels.batch_norm_backward) against aten.native_batch_norm_backward (what torch.compile's
            and our graphs ran) and cuDNN's batch-norm backward (eager's; it needs cuDNN's forward reserve).
Numerics are checked against aten in fp32 first. Times are triton.testing.do_bench_cudagraph medians (each call replayed in a CUDA graph: GPU
time, without the host's launch cost; --timer events for eager calls), and the
bandwidth column is the minimal bytes (forward: x read twice, y written; backward: g and x twice, dx written)
over the time. With --sweep it also times a grid of config rules (block_c, tile, programs per SM, warps) on every
shape and reports each shape's best and the rules with the best per-step total. Prints a per-step total table last; the rows go to DIR/bn_kernels.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402
from resfuse.kernels.batch_norm import BnConfig  # noqa: E402

aten = torch.ops.aten
TIMER = "graph"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def resnet50_bn_shapes(batch: int) -> collections.Counter:
    import torchvision

    model = torchvision.models.resnet50().to("meta")
    shapes = collections.Counter()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.register_forward_hook(lambda mod, inp, out: shapes.update([tuple(out.shape)]))
    model(torch.empty(batch, 3, 224, 224, device="meta"))
    return shapes


RULES = [(bc, tile, per_sm, warps) for bc in (32, 64, 128) for tile in (2048, 4096, 8192) for per_sm in (2, 4, 8, 16)
         for warps in (4, 8)]


def rule_config(rule, c: int, m: int, sms: int) -> BnConfig:
    """The config a shape-independent rule gives one shape, clipped to the channels as default_config clips."""
    bc, tile, per_sm, warps = rule
    bc = min(bc, triton.next_power_of_2(c))
    bp = tile // bc
    splits = max(1, min(triton.cdiv(m, bp), per_sm * sms // triton.cdiv(c, bc)))
    return BnConfig(bp, bc, splits, min(triton.next_power_of_2(splits), 256), warps)


def rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def one_shape(shape, dtype, sweep: bool, sms: int) -> dict:
    n, c, h, w = shape
    cl = torch.channels_last
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).to(dtype).contiguous(memory_format=cl)
    g = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=cl)
    wt, b = torch.rand(c, device="cuda") + 0.5, torch.randn(c, device="cuda")
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    numel = x.numel() * x.element_size()
    row = {"shape": list(shape), "dtype": str(dtype)}

    def ours_fwd(cfg=None):
        return kernels.batch_norm_train(x, wt, b, rm, rv, [], "relu(acc)", 0.1, 1e-5, config=cfg)

    def aten_fwd():
        out = aten._native_batch_norm_legit_functional(x, wt, b, rm, rv, True, 0.1, 1e-5)
        return (torch.relu(out[0]), *out[1:])

    def cudnn_fwd():
        out = aten.cudnn_batch_norm(x, wt, b, rm.clone(), rv.clone(), True, 0.1, 1e-5)
        return (out[0].relu_(), *out[1:])

    y, mean, invstd, _, _ = ours_fwd()
    ref = aten_fwd()
    row["fwd_err"] = max(rel_err(y, ref[0]), rel_err(mean, ref[1]), rel_err(invstd, ref[2]))
    dx = torch.empty_like(x)

    def ours_bwd(cfg=None):
        return kernels.batch_norm_backward(g, x, wt, mean, invstd, (True, True, True), dx, cfg)

    def aten_bwd():
        return aten.native_batch_norm_backward(g, x, wt, rm, rv, mean, invstd, True, 1e-5, [True, True, True])

    _, save_mean, save_var, reserve = aten.cudnn_batch_norm(x, wt, b, rm.clone(), rv.clone(), True, 0.1, 1e-5)

    def cudnn_bwd():
        return aten.cudnn_batch_norm_backward(x, g, wt, rm, rv, save_mean, save_var, 1e-5, reserve)

    got, want = ours_bwd(), aten_bwd()
    row["bwd_err"] = max(rel_err(a, b_) for a, b_ in zip(got, want))
    def bench(fn):
        if TIMER == "graph":  # GPU time alone: at small shapes the host's launches would be timed otherwise
            return do_bench_cudagraph(fn, rep=40)
        return do_bench(fn, warmup=10, rep=40)

    for name, fn in [("ours_fwd", ours_fwd), ("aten_fwd", aten_fwd), ("cudnn_fwd", cudnn_fwd),
                     ("ours_bwd", ours_bwd), ("aten_bwd", aten_bwd), ("cudnn_bwd", cudnn_bwd)]:
        row[name] = bench(fn) * 1e3
    row["fwd_floor_gbs"] = 3 * numel / row["ours_fwd"] / 1e3
    row["bwd_floor_gbs"] = 5 * numel / row["ours_bwd"] / 1e3
    if sweep:  # every rule's time on this shape; main() picks the rule with the best per-step total
        row["sweep"] = {}
        for rule in RULES:
            cfg = rule_config(rule, c, n * h * w, sms)
            for d, fn in (("fwd", ours_fwd), ("bwd", ours_bwd)):
                try:
                    t = bench(lambda: fn(cfg)) * 1e3
                except Exception as e:  # an illegal or failing config is skipped, and said so
                    print(f"  {shape} {cfg}: {type(e).__name__}: {e}")
                    continue
                row["sweep"][f"{d} {rule}"] = t
        for d in ("fwd", "bwd"):
            t, key = min((t, k) for k, t in row["sweep"].items() if k.startswith(d))
            row[f"best_{d}"], row[f"best_{d}_rule"] = t, key
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--timer", choices=("graph", "events"), default="graph",
                   help="graph: replay each call in a CUDA graph (GPU time, as training under graph trees sees "
                        "it); events: eager calls, host launch time included")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    global TIMER
    TIMER = args.timer
    dtype = DTYPES[args.dtype]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape, count in sorted(resnet50_bn_shapes(args.batch).items(), key=lambda kv: -kv[0][1]):
        row = one_shape(shape, dtype, args.sweep, sms)
        row["count"] = count
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bn_kernels.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "batch": args.batch, "dtype": args.dtype, "rows": rows},
                  f, indent=1)
    cols = ["ours_fwd", "aten_fwd", "cudnn_fwd", "ours_bwd", "aten_bwd", "cudnn_bwd"]
    cols += ["best_fwd", "best_bwd"] if args.sweep else []
    print(f"\n{torch.cuda.get_device_name()}, ResNet-50 bs{args.batch} {args.dtype} channels_last; us per call")
    print(f"{'shape':>22} {'n':>2} " + " ".join(f"{c:>9}" for c in cols) + "  fwdGB/s bwdGB/s  err f/b")
    for r in rows:
        print(f"{str(tuple(r['shape'])):>22} {r['count']:>2} " + " ".join(f"{r.get(c, 0):9.1f}" for c in cols)
              + f"  {r['fwd_floor_gbs']:7.0f} {r['bwd_floor_gbs']:7.0f}  {r['fwd_err']:.1e}/{r['bwd_err']:.1e}")
    totals = {c: sum(r.get(c, 0) * r["count"] for r in rows) / 1e3 for c in cols}
    print(f"{'per step (ms)':>25} " + " ".join(f"{totals[c]:9.2f}" for c in cols))
    if args.sweep:  # one rule for every shape, as default_config must be: the per-step total of each
        for d in ("fwd", "bwd"):
            keys = [k for k in rows[0]["sweep"] if k.startswith(d) and all(k in r["sweep"] for r in rows)]
            step = sorted((sum(r["sweep"][k] * r["count"] for r in rows) / 1e3, k) for k in keys)
            print(f"{d}: best rules (bc, tile, programs per SM, warps), ms per step: "
                  + ", ".join(f"{k.split(' ', 1)[1]} {t:.2f}" for t, k in step[:5]))


if __name__ == "__main__":
    main()
