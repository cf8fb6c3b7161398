"""Can cuDNN's runtime fusion compute batch norm's statistics inside the convolution (GPU machine)?

  python3 bench/cudnn_genstats.py [--batch 256] [--out DIR]

For each distinct forward conv of torchvision's ResNet-50 (fp16, channels_last), with how often it occurs:
  aten:          F.conv2d, then kernels.batch_norm_stats over its output (what the training step runs now);
  fprop:         a cuDNN frontend graph, conv_fprop alone;
  fprop+genstats: conv_fprop whose output also feeds a genstats node (per-channel sum and sum of squares);
  fprop+reduce:  the same sums as two reduction nodes (y and y * y);
  sbr+fprop+genstats: fprop+genstats reading relu(x * scale + bias), the batch norm before it applied on the fly;
and for the data gradient, with relu's backward and batch norm backward's two sums in the same graph:
  dgrad:         conv_dgrad alone;  dgrad+sums: relu_backward on it, then sum(g) and sum(g * (x - mean)).
Each variant is built only if cuDNN supports it (the reason is printed when not). The sums are checked against
float64 sums of the fp16 output, and against a second run's (bit-identical or not). Times:
triton.testing.do_bench_cudagraph medians (us). Rows go to
DIR/cudnn_genstats.json; a table prints last.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402

import cudnn  # noqa: E402

HALF, FLOAT = cudnn.data_type.HALF, cudnn.data_type.FLOAT


def conv_shapes(batch: int) -> collections.Counter:
    """(x shape, w shape, stride, padding) of each conv in ResNet-50, counted."""
    import torchvision

    model = torchvision.models.resnet50().to("meta")
    shapes = collections.Counter()
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(lambda mod, inp, out: shapes.update(
                [(tuple(inp[0].shape), tuple(mod.weight.shape), mod.stride[0], mod.padding[0])]))
    model(torch.empty(batch, 3, 224, 224, device="meta"))
    return shapes


def cl(shape, dtype=torch.float16):
    return torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)


def _graph(handle):
    return cudnn.pygraph(io_data_type=HALF, intermediate_data_type=FLOAT, compute_data_type=FLOAT, handle=handle)


def _t(g, t, name, dtype=HALF):
    return g.tensor(dim=list(t.shape), stride=list(t.stride()), data_type=dtype, name=name)


def _build(g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g


def _runner(handle, g, binding):
    ws = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device="cuda")

    def run():
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
        g.execute(binding, ws, handle=handle)
    return run


def fprop(handle, x, w, y, stride, pad, stats: str, sbr=None):
    """A runner for conv_fprop into y, plus (stats="genstats" or "reduce") the sums into s, ss ([1, C, 1, 1] fp32);
    with sbr=(scale, bias), fp16 [1, C_in, 1, 1], the conv reads relu(x * scale + bias)."""
    g = _graph(handle)
    tx, tw = _t(g, x, "x"), _t(g, w, "w")
    image = tx
    if sbr is not None:
        ts, tb = _t(g, sbr[0], "scale"), _t(g, sbr[1], "bias")
        image = g.relu(input=g.add(a=g.mul(a=tx, b=ts), b=tb))
    ty = g.conv_fprop(image=image, weight=tw, padding=[pad, pad], stride=[stride, stride], dilation=[1, 1],
                      compute_data_type=FLOAT, name="conv")
    ty.set_output(True).set_data_type(HALF).set_dim(list(y.shape)).set_stride(list(y.stride()))
    binding = {tx: x, tw: w, ty: y} | ({ts: sbr[0], tb: sbr[1]} if sbr is not None else {})
    c = y.shape[1]
    sums = torch.zeros(2, 1, c, 1, 1, device="cuda")
    if stats == "genstats":
        s, ss = g.genstats(input=ty, compute_data_type=FLOAT, name="stats")
    elif stats == "reduce":
        s = g.reduction(input=ty, mode=cudnn.reduction_mode.ADD, compute_data_type=FLOAT, name="sum")
        ss = g.reduction(input=g.mul(a=ty, b=ty, compute_data_type=FLOAT), mode=cudnn.reduction_mode.ADD,
                         compute_data_type=FLOAT, name="sumsq")
    if stats:
        for t, buf in ((s, sums[0]), (ss, sums[1])):
            t.set_output(True).set_data_type(FLOAT).set_dim([1, c, 1, 1]).set_stride([c, 1, c, c])
            binding[t] = buf
    return _runner(handle, _build(g), binding), sums


def dgrad(handle, dy, w, dx, stride, pad, mask, x, mean, sums_too: bool):
    """A runner for conv_dgrad into dx; with sums_too, dx = relu_backward(dgrad, mask), plus sum(dx) and
    sum(dx * (x - mean)) into the returned [2, 1, C, 1, 1] buffer."""
    g = _graph(handle)
    tdy, tw = _t(g, dy, "dy"), _t(g, w, "w")
    acc = g.conv_dgrad(loss=tdy, filter=tw, padding=[pad, pad], stride=[stride, stride], dilation=[1, 1],
                       compute_data_type=FLOAT, name="dgrad")
    binding = {tdy: dy, tw: w}
    c = dx.shape[1]
    sums = torch.zeros(2, 1, c, 1, 1, device="cuda")
    out = acc
    if sums_too:
        tm, tx, tmean = _t(g, mask, "mask"), _t(g, x, "x"), _t(g, mean, "mean", FLOAT)
        out = g.relu_backward(loss=acc, input=tm, compute_data_type=FLOAT, name="drelu")
        s = g.reduction(input=out, mode=cudnn.reduction_mode.ADD, compute_data_type=FLOAT, name="sum")
        sx = g.reduction(input=g.mul(a=out, b=g.sub(a=tx, b=tmean, compute_data_type=FLOAT),
                                     compute_data_type=FLOAT),
                         mode=cudnn.reduction_mode.ADD, compute_data_type=FLOAT, name="sumx")
        binding |= {tm: mask, tx: x, tmean: mean}
        for t, buf in ((s, sums[0]), (sx, sums[1])):
            t.set_output(True).set_data_type(FLOAT).set_dim([1, c, 1, 1]).set_stride([c, 1, c, c])
            binding[t] = buf
    out.set_output(True).set_data_type(HALF).set_dim(list(dx.shape)).set_stride(list(dx.stride()))
    binding[out] = dx
    return _runner(handle, _build(g), binding), sums


def bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=50) * 1e3


def relerr(got, ref) -> float:
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def one(handle, xs, ws, stride, pad) -> dict:
    x, w = cl(xs), cl(ws) * 0.05
    y = F.conv2d(x, w, stride=stride, padding=pad)
    c = y.shape[1]
    ones, zeros = torch.ones(c, device="cuda"), torch.zeros(c, device="cuda")
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    row = {"x": xs, "w": ws, "stride": stride, "pad": pad}
    row["aten_conv"] = bench(lambda: F.conv2d(x, w, stride=stride, padding=pad))
    row["aten_stats"] = bench(lambda: kernels.batch_norm_stats(y, ones, zeros, rm, rv, 0.1, 1e-5))
    ref = torch.stack([y.double().sum((0, 2, 3)), (y.double() ** 2).sum((0, 2, 3))])
    scale = torch.rand(1, xs[1], 1, 1, device="cuda").half() + 0.5
    bias = torch.randn(1, xs[1], 1, 1, device="cuda").half()
    y_sbr = F.conv2d(torch.relu(x.float() * scale + bias).half(), w, stride=stride, padding=pad)
    ref_sbr = torch.stack([y_sbr.double().sum((0, 2, 3)), (y_sbr.double() ** 2).sum((0, 2, 3))])
    for stats, sbr in (("", None), ("genstats", None), ("reduce", None), ("genstats", (scale, bias))):
        name = ("sbr+" if sbr else "") + "fprop" + (f"+{stats}" if stats else "")
        try:
            out = torch.full_like(y, float("nan"))
            run, sums = fprop(handle, x, w, out, stride, pad, stats, sbr)
            run()
            torch.cuda.synchronize()
            row[f"{name}_yerr"] = relerr(out, (y_sbr if sbr else y).double())
            if stats:
                row[f"{name}_err"] = relerr(sums.view(2, c), ref_sbr if sbr else ref)
                first = sums.clone()
                run()
                row[f"{name}_bit_identical"] = torch.equal(first, sums)
                row[f"{name}_rerun_err"] = relerr(sums.view(2, c), ref_sbr if sbr else ref)  # accumulates?
                sums.fill_(float("nan"))
                run()
                row[f"{name}_poisoned_err"] = relerr(sums.view(2, c), ref_sbr if sbr else ref)  # overwrites?
            row[name] = bench(run)
        except Exception as e:  # cuDNN has no engine for this graph
            row[name] = None
            row[f"{name}_why"] = f"{type(e).__name__}: {str(e)[:200]}"
    # the data gradient of the same conv: dy has y's shape, dx has x's
    dy, mask, mean = cl(y.shape) * 0.1, cl(xs), torch.randn(1, xs[1], 1, 1, device="cuda")
    dx_ref = torch.ops.aten.convolution_backward(dy, x, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1,
                                                 [True, False, False])[0]
    row["aten_dgrad"] = bench(lambda: torch.ops.aten.convolution_backward(
        dy, x, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1, [True, False, False]))
    g_ref = dx_ref.double() * (mask > 0)
    sref = torch.stack([g_ref.sum((0, 2, 3)), (g_ref * (x.double() - mean.double())).sum((0, 2, 3))])
    for sums_too in (False, True):
        name = "dgrad+sums" if sums_too else "dgrad"
        try:
            dx = torch.full_like(x, float("nan"))
            run, sums = dgrad(handle, dy, w, dx, stride, pad, mask, x, mean, sums_too)
            run()
            torch.cuda.synchronize()
            row[f"{name}_dxerr"] = relerr(dx, g_ref if sums_too else dx_ref.double())
            if sums_too:
                row[f"{name}_err"] = relerr(sums.view(2, -1), sref)
            row[name] = bench(run)
        except Exception as e:
            row[name] = None
            row[f"{name}_why"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    handle = cudnn.create_handle()
    rows = []
    for (xs, ws, stride, pad), n in conv_shapes(args.batch).items():
        row = one(handle, xs, ws, stride, pad) | {"count": n}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "cudnn_genstats.json"), "w") as f:
            json.dump(rows, f, indent=1)
    cols = ["aten_conv", "aten_stats", "fprop", "fprop+genstats", "fprop+reduce", "sbr+fprop+genstats", "aten_dgrad",
            "dgrad", "dgrad+sums"]
    print(f"\n{torch.cuda.get_device_name()}, ResNet-50 bs{args.batch} fp16 channels_last; us per call")
    print(f"{'x':>20} {'w':>18} s  n " + " ".join(f"{c:>14}" for c in cols))
    total = collections.Counter()
    for r in rows:
        vals = [r.get(c) for c in cols]
        print(f"{str(r['x']):>20} {str(r['w']):>18} {r['stride']} {r['count']:2d} "
              + " ".join(f"{v:14.1f}" if v else f"{'-':>14}" for v in vals))
        for c, v in zip(cols, vals):
            total[c] += (v or float("nan")) * r["count"]
    print(f"{'per step (ms)':>44} " + " ".join(f"{total[c] / 1e3:14.2f}" for c in cols))
    for r in rows[:3]:
        print({k: v for k, v in r.items() if k.endswith(("_why", "_err", "_yerr", "_dxerr", "_identical"))})
    print("genstats sums bit-identical run to run on every shape:",
          all(r.get("fprop+genstats_bit_identical", False) for r in rows))


if __name__ == "__main__":
    main()
