"""Does ResNet's 3-channel stem conv run faster with its input channels zero-padded ahead of cuDNN (GPU machine)?

  python3 bench/stem_pad.py [--batches 256,32,1] [--out DIR]

cuDNN pads a 3-channel NHWC input to 4 itself (nhwcAddPadding, a pass over the image) before its first-layer
kernel, in the forward and again in the weight gradient. Here the stem (7x7, stride 2, pad 3, 64 filters; fp16,
channels_last) runs with C = 3 as the model has it, and with x and w zero-padded to C = 4 and C = 8 beforehand:
  fprop:   F.conv2d;  wgrad: aten.convolution_backward for the weight only (the image needs no gradient);
  cast:    the fp32 image to fp16 channels_last, as autocast does, compiled by Inductor, with the pad fused in;
  ours:    the same cast and pad by resfuse::pad_channels (kernels/padding.py);
  genstats: cuDNN frontend conv_fprop + genstats (the batch norm's sums), where cuDNN has an engine for it.
Outputs are checked against the 3-channel conv's (the padded channels are zeros). Each variant's kernels are
listed from a profiler trace. Times: triton.testing.do_bench_cudagraph medians (us). Rows go to
DIR/stem_pad.json; a table prints last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from cudnn_genstats import bench, fprop  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import ops  # noqa: E402

import cudnn  # noqa: E402


def kernels_of(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:70] for e in prof.events() if e.device_type.name == "CUDA"})


def padded(t: torch.Tensor, c: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, 0, 0, c - t.shape[1])).contiguous(memory_format=torch.channels_last)


def one(handle, batch: int) -> dict:
    image = torch.randn(batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    x3 = image.half()
    w3 = (torch.randn(64, 3, 7, 7, device="cuda") * 0.1).half().contiguous(memory_format=torch.channels_last)
    y3 = F.conv2d(x3, w3, stride=2, padding=3)
    dy = (torch.randn_like(y3) * 0.1).contiguous(memory_format=torch.channels_last)

    def wgrad(x, w):
        return torch.ops.aten.convolution_backward(dy, x, w, None, [2, 2], [3, 3], [1, 1], False, [0, 0], 1,
                                                   [False, True, False])[1]
    dw3 = wgrad(x3, w3)
    row = {"batch": batch}
    for c in (3, 4, 8):
        x, w = (x3, w3) if c == 3 else (padded(x3, c), padded(w3, c))
        y, dw = F.conv2d(x, w, stride=2, padding=3), wgrad(x, w)
        row[f"c{c}_y_equal"] = torch.equal(y, y3)
        row[f"c{c}_y_maxdiff"] = (y.float() - y3.float()).abs().max().item()
        row[f"c{c}_dw_maxdiff"] = (dw[:, :3].float() - dw3.float()).abs().max().item() / dw3.float().abs().max().item()
        row[f"c{c}_dw_pad_zero"] = bool((dw[:, 3:] == 0).all()) if c > 3 else True
        row[f"c{c}_fprop"] = bench(lambda: F.conv2d(x, w, stride=2, padding=3))
        row[f"c{c}_wgrad"] = bench(lambda: wgrad(x, w))
        row[f"c{c}_fprop_kernels"] = kernels_of(lambda: F.conv2d(x, w, stride=2, padding=3))
        row[f"c{c}_wgrad_kernels"] = kernels_of(lambda: wgrad(x, w))
        cast = torch.compile(lambda t: t.half() if c == 3 else F.pad(t.half(), (0, 0, 0, 0, 0, c - 3)))
        out = cast(image)
        row[f"c{c}_cast_channels_last"] = out.is_contiguous(memory_format=torch.channels_last)
        row[f"c{c}_cast"] = bench(lambda: cast(image))
        if c > 3:
            row[f"c{c}_ours_equal"] = torch.equal(ops.pad_channels(image, c, torch.float16, "triton"), x)
            row[f"c{c}_ours"] = bench(lambda: ops.pad_channels(image, c, torch.float16, "triton"))
        try:
            ys = torch.empty_like(y)
            run, sums = fprop(handle, x, w, ys, 2, 3, "genstats")
            run()
            torch.cuda.synchronize()
            ref = torch.stack([y3.double().sum((0, 2, 3)), (y3.double() ** 2).sum((0, 2, 3))])
            row[f"c{c}_genstats_err"] = ((sums.view(2, -1).double() - ref).norm() / ref.norm()).item()
            row[f"c{c}_genstats"] = bench(run)
        except Exception as e:  # cuDNN has no engine for this graph
            row[f"c{c}_genstats"] = None
            row[f"c{c}_genstats_why"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def sweep(batch: int) -> list:
    """Our cast-and-pad kernel's time per tile (pixels a program, warps) on the bs-`batch` image."""
    from resfuse.kernels.padding import pad_channels

    image = torch.randn(batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    ref = padded(image.half(), 4)
    out = torch.empty_like(ref)
    rows = []
    for tile in [(256, 4), (512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (8192, 8)]:
        out.fill_(float("nan"))
        pad_channels(image, out, tile)
        rows.append({"tile": tile, "equal": torch.equal(out, ref),
                     "us": bench(lambda: pad_channels(image, out, tile))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="256,32,1")
    p.add_argument("--sweep", action="store_true", help="only time our kernel's tiles, at the first batch")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    if args.sweep:
        rows = sweep(int(args.batches.split(",")[0]))
        with open(os.path.join(args.out, "stem_pad_sweep.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return
    handle = cudnn.create_handle()
    rows = []
    for b in map(int, args.batches.split(",")):
        rows.append(one(handle, b))
        print(json.dumps(rows[-1]), flush=True)
        with open(os.path.join(args.out, "stem_pad.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, ResNet-50 stem conv, fp16 channels_last; us per call")
    cols = ["fprop", "wgrad", "cast", "ours", "genstats"]
    print(f"{'batch':>5} {'C':>2} " + " ".join(f"{c:>9}" for c in cols) + "  y equal  dw rel diff")
    for r in rows:
        for c in (3, 4, 8):
            vals = [r.get(f"c{c}_{k}") for k in cols]
            print(f"{r['batch']:5d} {c:2d} " + " ".join(f"{v:9.1f}" if v else f"{'-':>9}" for v in vals)
                  + f"  {str(r[f'c{c}_y_equal']):>7}  {r[f'c{c}_dw_maxdiff']:.1e}")


if __name__ == "__main__":
    main()
