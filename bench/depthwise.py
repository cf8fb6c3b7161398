"""GPU benchmark of the depthwise conv kernel against cuDNN, on the zoo's depthwise shapes (fp16, channels_last).

Entry point: `python bench/depthwise.py [--batches 1,256] [--cases SUBSTR,...] [--strips] [--scalar-channels]
[--out DIR]`, on a GPU machine. For each case it checks every config of the fast level (and with --strips the
strip mainloop's tiles, STRIPS) against an fp32 reference, then times (CUDA-graph replays, the tuner's
`_bench`): our kernel with the case's epilogue, at its best config and at the heuristic default; cuDNN's conv
alone; cuDNN's conv followed by the same epilogue in our generated kernel (the "aten+epilogue" provider, what ran
before this kernel existed); and the memory floor (input + weights + output at the measured copy bandwidth). With
--cudnn-graph, also the cuDNN provider's fused graph (the batch norm folded into the weight) on the grouped conv,
which the provider refuses today (`providers/cudnn.py` builds its graphs for groups=1): each of its engine
configs is checked against the reference and the best one timed, or the reason cuDNN gave is printed. The
table prints last; rows go to DIR/depthwise.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402
from resfuse.kernels.conv2d_depthwise import DepthwiseConfig, default_config, fast_configs  # noqa: E402
from resfuse.kernels.conv2d_fprop import ConvProblem  # noqa: E402
from resfuse.ops.fused import conv_out_shape  # noqa: E402
from resfuse.tuning.choose import _bench  # noqa: E402

BIAS = "add(acc,c0)"
BN_ACT = "{act}(bn[#1e-05](acc,c0,c1,c2,c3))"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    c: int
    r: int
    hw: int  # input height = width
    stride: int
    signature: str


CASES = [  # ConvNeXt-T's four stages (7x7 + bias), then MobileNetV3-L's and EfficientNet-B0's typical layers
    Case("convnext s1 7x7 96", 96, 7, 56, 1, BIAS),
    Case("convnext s2 7x7 192", 192, 7, 28, 1, BIAS),
    Case("convnext s3 7x7 384", 384, 7, 14, 1, BIAS),
    Case("convnext s4 7x7 768", 768, 7, 7, 1, BIAS),
    Case("mbv3 3x3 64 s2 relu", 64, 3, 112, 2, BN_ACT.format(act="relu")),
    Case("mbv3 3x3 72 relu", 72, 3, 56, 1, BN_ACT.format(act="relu")),
    Case("mbv3 5x5 72 s2 relu", 72, 5, 56, 2, BN_ACT.format(act="relu")),
    Case("mbv3 5x5 120 hswish", 120, 5, 28, 1, BN_ACT.format(act="hardswish")),
    Case("mbv3 3x3 200 hswish", 200, 3, 14, 1, BN_ACT.format(act="hardswish")),
    Case("mbv3 3x3 184 hswish", 184, 3, 14, 1, BN_ACT.format(act="hardswish")),
    Case("mbv3 3x3 480 hswish", 480, 3, 14, 1, BN_ACT.format(act="hardswish")),
    Case("effnet 3x3 96 s2 silu", 96, 3, 112, 2, BN_ACT.format(act="silu")),
    Case("effnet 5x5 240 silu", 240, 5, 28, 1, BN_ACT.format(act="silu")),
    Case("effnet 5x5 1152 silu", 1152, 5, 7, 1, BN_ACT.format(act="silu")),
]


def operands(case: Case, dtype) -> list[torch.Tensor]:
    if case.signature == BIAS:
        return [torch.randn(case.c, device="cuda", dtype=dtype)]
    mean, var = torch.randn(case.c, device="cuda"), torch.rand(case.c, device="cuda") + 0.5
    return [t.to(dtype) for t in (mean, var, torch.randn_like(mean), torch.randn_like(mean))]


def reference(x, w, case: Case, ops) -> torch.Tensor:
    acc = F.conv2d(x.float(), w.float(), None, case.stride, case.r // 2, 1, case.c)
    if case.signature == BIAS:
        return acc + ops[0].float().view(1, -1, 1, 1)
    mean, var, weight, bias = (t.float() for t in ops)
    y = F.batch_norm(acc, mean, var, weight, bias, eps=1e-5)
    act = case.signature.split("(")[0]
    return {"relu": F.relu, "hardswish": F.hardswish, "silu": F.silu}[act](y)


# the strip mainloop's tiles (block_h, block_w, block_n, num_warps, strip), timed with --strips
STRIPS = [(8, 32, 32, 4, 8), (4, 32, 32, 2, 8), (8, 16, 32, 2, 8), (4, 16, 32, 2, 8), (4, 16, 64, 4, 8),
          (8, 16, 64, 4, 8), (2, 32, 32, 2, 8), (16, 16, 32, 4, 8), (8, 8, 32, 1, 8), (8, 16, 32, 4, 4),
          (4, 16, 32, 2, 4), (8, 8, 64, 2, 8)]


def cudnn_graph(x, w, ops, case: Case, stride, pad, ref) -> tuple[float, float, str]:
    """(best us, its error, its engine) of the cuDNN provider's candidates for this grouped conv, or nan and why."""
    from resfuse.ops.fused import Output
    from resfuse.providers import cudnn
    from resfuse.tuning.choose import Call

    out = Output.of(ref.shape, x.dtype, x.device, torch.channels_last)
    call = Call("conv2d", (x, w), ops, case.signature, (stride, pad, [1, 1]), out)
    found = []
    for cand in cudnn.candidates(call, "fast"):
        try:
            y = cand.run()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            found.append((_bench(cand.run) * 1e6, err, cand.name))
        except Exception as e:  # noqa: BLE001  an engine config that does not build is skipped
            print(f"  {case.name}: {cand.name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    ok = [f for f in found if f[1] < 5e-3]
    return min(ok) if ok else (float("nan"), min((f[1] for f in found), default=float("nan")), "none")


def measure(case: Case, batch: int, copy_bw: float, dtype=torch.float16, strips: bool = False,
            graph: bool = False) -> dict:
    x = torch.randn(batch, case.c, case.hw, case.hw, device="cuda", dtype=dtype).contiguous(
        memory_format=torch.channels_last)
    w = (torch.randn(case.c, 1, case.r, case.r, device="cuda", dtype=dtype) / case.r).contiguous(
        memory_format=torch.channels_last)
    ops = operands(case, dtype)
    stride, pad = [case.stride] * 2, [case.r // 2] * 2
    shape = conv_out_shape(x, w, stride, pad, [1, 1])
    ref = reference(x, w, case, ops)

    def ours(cfg, out):
        return kernels.conv2d(x, w, ops, case.signature, stride, pad, [1, 1], out, cfg)

    p = ConvProblem(batch, case.c, case.c, case.r, case.r, *shape[2:], 2, torch.cuda.get_device_properties(0)
                    .multi_processor_count, case.stride == 1)
    default = default_config(p)
    times, errors = {}, {}
    extra = [DepthwiseConfig(*t) for t in STRIPS] if strips else []
    for cfg in dict.fromkeys([default, *fast_configs(default, p), *extra]):
        if not cfg.check(p):
            continue
        out = torch.full(shape, float("nan"), device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
        ours(cfg, out)
        errors[cfg] = ((out.float() - ref).norm() / ref.norm()).item()
        times[cfg] = _bench(lambda cfg=cfg, out=out: ours(cfg, out))
        if strips:
            print(f"  {case.name} bs{batch} {cfg}: {times[cfg] * 1e6:.1f} us, err {errors[cfg]:.1e}", flush=True)
    best = min(times, key=times.get)
    out = torch.empty(shape, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)

    def cudnn():
        return F.conv2d(x, w, None, stride, pad, 1, case.c)

    def cudnn_epilogue():
        acc = cudnn()
        return kernels.epilogue(acc, ops, case.signature, acc, 1)

    floor_s = (x.numel() + w.numel() + out.numel()) * x.element_size() / copy_bw
    row = dict(case=case.name, batch=batch, signature=case.signature, max_rel_err=max(errors.values()),
               ours_us=times[best] * 1e6, ours_default_us=times[default] * 1e6, best_config=dataclasses.asdict(best),
               cudnn_us=_bench(cudnn) * 1e6, cudnn_epilogue_us=_bench(cudnn_epilogue) * 1e6, floor_us=floor_s * 1e6)
    if graph:
        row["cudnn_graph_us"], row["cudnn_graph_err"], row["cudnn_graph_engine"] = cudnn_graph(
            x, w, ops, case, stride, pad, ref)
    return row


def copy_bandwidth() -> float:
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _bench(lambda: dst.copy_(src))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,256")
    p.add_argument("--cases", default="", help="comma-separated substrings of the case names to run")
    p.add_argument("--strips", action="store_true", help="also time the strip mainloop's tiles (STRIPS), each")
    p.add_argument("--scalar-channels", action="store_true",
                   help="KV = 1: the channel mask and output strides as before the channel vectors (an A/B)")
    p.add_argument("--cudnn-graph", action="store_true",
                   help="also time cuDNN's fused graph on the grouped conv (the batch norm folded), a probe")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.scalar_channels:
        from resfuse.kernels import launch
        launch.channel_vector = lambda channels, *strides: 1
    wanted = [w for w in args.cases.split(",") if w]
    torch.backends.cudnn.benchmark = True
    bw = copy_bandwidth()
    rows = []
    for batch in map(int, args.batches.split(",")):
        for case in CASES:
            if wanted and not any(w in case.name for w in wanted):
                continue
            rows.append(measure(case, batch, bw, strips=args.strips, graph=args.cudnn_graph))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "depthwise.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bytes_per_s=bw, rows=rows), f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, fp16 channels_last, us (copy {bw / 1e12:.2f} TB/s)")
    print(f"{'case':26} {'bs':>4} {'floor':>8} {'ours':>8} {'default':>8} {'cuDNN':>8} {'cuDNN+epi':>9} "
          f"{'vs cuDNN+epi':>12} {'err':>8} {'graph':>8}  best config")
    for r in rows:
        cfg = DepthwiseConfig(**r["best_config"])
        print(f"{r['case']:26} {r['batch']:>4} {r['floor_us']:8.1f} {r['ours_us']:8.1f} {r['ours_default_us']:8.1f} "
              f"{r['cudnn_us']:8.1f} {r['cudnn_epilogue_us']:9.1f} {r['cudnn_epilogue_us'] / r['ours_us']:11.2f}x "
              f"{r['max_rel_err']:8.1e} {r.get('cudnn_graph_us', float('nan')):8.1f}  "
              f"{cfg.block_h}x{cfg.block_w}x{cfg.block_n}/{cfg.num_warps}w strip {cfg.strip}")


if __name__ == "__main__":
    main()
