"""GPU benchmark of the fused Triton kernels (issue 3): ResNet-50 conv layers and BERT-base GEMMs.

Entry point: `python bench/kernels.py [--dtypes fp16,bf16] [--batches 1,32,256] [--only conv,gemm]
[--compile-dtypes fp16] [--out DIR]`, run on a GPU machine. For every case it checks numerics against an fp32
reference (upcast inputs, TF32 off), then times with triton.testing.do_bench (median, L2 flushed between
runs): our fused kernel; cuDNN conv / cuBLAS mm followed by the unfused eager elementwise ops; torch.compile
(default mode) of that same unfused chain; and the bare cuDNN conv / cuBLAS mm. It measures the two
ceilings (fp16 mm rate, device copy bandwidth) in the same run and prints each case's roofline floor.
The table goes to stdout last; the full rows go to DIR/kernels.json and DIR/kernels.log.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import epilogue as epi  # noqa: E402
from resfuse import kernels  # noqa: E402
from resfuse.ops.fused import conv_out_shape  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DNAME = {v: k for k, v in DTYPES.items()}
BN_RELU = "relu(bn[#1e-05](acc,c0,c1,c2,c3))"
BN_ADD_RELU = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))"


@dataclasses.dataclass(frozen=True)
class ConvCase:
    name: str
    c: int
    k: int
    r: int
    hw: int  # input height = width
    stride: int
    tail: bool  # bottleneck tail: bn + residual add + relu; else bn + relu

    @property
    def pad(self) -> int:
        return self.r // 2


# The distinct conv shapes of torchvision ResNet-50 (v1.5: the stride sits on the 3x3); downsample 1x1s omitted.
RESNET50 = [
    ConvCase("stem 7x7 3>64 s2", 3, 64, 7, 224, 2, False),
    ConvCase("l1 1x1 64>64", 64, 64, 1, 56, 1, False),
    ConvCase("l1 3x3 64>64", 64, 64, 3, 56, 1, False),
    ConvCase("l1 1x1 64>256 tail", 64, 256, 1, 56, 1, True),
    ConvCase("l1 1x1 256>64", 256, 64, 1, 56, 1, False),
    ConvCase("l2 1x1 256>128", 256, 128, 1, 56, 1, False),
    ConvCase("l2 3x3 128 s2", 128, 128, 3, 56, 2, False),
    ConvCase("l2 3x3 128>128", 128, 128, 3, 28, 1, False),
    ConvCase("l2 1x1 128>512 tail", 128, 512, 1, 28, 1, True),
    ConvCase("l2 1x1 512>128", 512, 128, 1, 28, 1, False),
    ConvCase("l3 3x3 256 s2", 256, 256, 3, 28, 2, False),
    ConvCase("l3 3x3 256>256", 256, 256, 3, 14, 1, False),
    ConvCase("l3 1x1 256>1024 tail", 256, 1024, 1, 14, 1, True),
    ConvCase("l3 1x1 1024>256", 1024, 256, 1, 14, 1, False),
    ConvCase("l4 3x3 512 s2", 512, 512, 3, 14, 2, False),
    ConvCase("l4 3x3 512>512", 512, 512, 3, 7, 1, False),
    ConvCase("l4 1x1 512>2048 tail", 512, 2048, 1, 7, 1, True),
    ConvCase("l4 1x1 2048>512", 2048, 512, 1, 7, 1, False),
]

# BERT-base, batch 32 x seq 384 tokens: (name, M, N, K, signature)
BERT = [
    ("qkv-like 768>768 bias", 12288, 768, 768, "add(acc,c0)"),
    ("ffn1 768>3072 bias+gelu", 12288, 3072, 768, "gelu(add(acc,c0))"),
    ("ffn2 3072>768 bias+add", 12288, 768, 3072, "add(add(acc,c0),full1)"),
]


def measure_ceilings() -> tuple[float, float]:
    """(fp16 mm FLOP/s, copy bytes/s counting read + write), measured on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    mm_ms = do_bench(lambda: torch.mm(a, b), return_mode="median")
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    cp_ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * 8192**3 / (mm_ms * 1e-3), 2 * src.numel() * 4 / (cp_ms * 1e-3)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out.float() - ref).norm() / ref.norm())


TIMER = {"graph": lambda fn: do_bench_cudagraph(fn, rep=100, return_mode="median"),
         "plain": lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")}
_timer = TIMER["graph"]


def bench(fn) -> float:
    return _timer(fn) * 1e3  # microseconds


def sweep(row_fn, patch_target: str, configs) -> list[tuple[str, float]]:
    """Time one case's fused kernel under each config (the tuner's job later; here it shows the headroom)."""
    from resfuse.kernels import launch
    default = getattr(launch, patch_target)
    found = []
    try:
        for cfg in configs:
            setattr(launch, patch_target, lambda p, cfg=cfg: cfg)
            launch._PLANS.clear()  # a cached plan holds the config it was built with
            found.append((str(cfg), row_fn()))
    finally:
        setattr(launch, patch_target, default)
        launch._PLANS.clear()
    return found


def compiled(fn, enabled: bool):
    return torch.compile(fn, dynamic=False) if enabled else None


def conv_row(case: ConvCase, n: int, dtype, peak: float, bw: float, use_compile: bool) -> dict:
    dev = "cuda"
    cl = torch.channels_last
    x = torch.randn(n, case.c, case.hw, case.hw, device=dev, dtype=dtype).contiguous(memory_format=cl)
    w = (torch.randn(case.k, case.c, case.r, case.r, device=dev, dtype=dtype) / (case.c * case.r**2) ** 0.5)
    w = w.contiguous(memory_format=cl)
    st, pd = (case.stride,) * 2, (case.pad,) * 2
    shape = conv_out_shape(x, w, st, pd, (1, 1))
    # BN statistics and affine in fp32, as torch keeps them under autocast; the kernel reads any dtype
    mean, wgt, bias = (torch.randn(case.k, device=dev) for _ in range(3))
    var = torch.rand(case.k, device=dev) + 0.5
    res = torch.randn(shape, device=dev, dtype=dtype).contiguous(memory_format=cl) if case.tail else None
    sig = BN_ADD_RELU if case.tail else BN_RELU
    ops = [t.view(-1, 1, 1) for t in (mean, var, wgt, bias)] + ([res] if case.tail else [])
    out = torch.full(shape, float("nan"), device=dev, dtype=dtype).contiguous(memory_format=cl)

    def ours():
        return kernels.conv2d(x, w, ops, sig, list(st), list(pd), [1, 1], out)

    def eager():
        y = F.batch_norm(F.conv2d(x, w, None, st, pd), mean, var, wgt, bias, False, 0.0, 1e-5)
        return torch.relu(y + res) if case.tail else torch.relu(y)

    ours()
    torch.backends.cudnn.allow_tf32 = False
    acc = F.conv2d(x.float(), w.float(), None, st, pd)
    ref = epi.reference(epi.parse(sig), epi.rows3(acc, acc.shape, 1),
                        [epi.rows3(t.float(), acc.shape, 1) for t in ops])
    err = rel_err(epi.rows3(out, out.shape, 1), ref)
    comp = compiled(eager, use_compile)
    flops = 2 * shape[0] * shape[2] * shape[3] * case.k * case.c * case.r**2
    nbytes = (x.numel() + w.numel() + out.numel() * (2 if case.tail else 1)) * x.element_size()
    return {
        "kind": "conv", "case": case.name, "batch": n, "dtype": DNAME[dtype], "relerr": err,
        "ours_us": bench(ours), "eager_us": bench(eager), "compile_us": bench(comp) if comp else None,
        "alone_us": bench(lambda: F.conv2d(x, w, None, st, pd)),
        "floor_us": max(flops / peak, nbytes / bw) * 1e6, "bound": "mem" if nbytes / bw > flops / peak else "math",
    }


def gemm_row(name, m, n, k, sig, dtype, peak, bw, use_compile) -> dict:
    dev = "cuda"
    a = torch.randn(m, k, device=dev, dtype=dtype)
    wt = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5  # nn.Linear weight [N, K]: B = W^T, column-major
    b = wt.t()
    bias = torch.randn(n, device=dev, dtype=dtype)
    res = torch.randn(m, n, device=dev, dtype=dtype)
    ops = [bias, res][: 2 if "full1" in sig else 1]
    out = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
    bare = torch.empty_like(out)

    def ours():
        return kernels.gemm(a, b, ops, sig, out)

    def eager():
        y = F.linear(a, wt) + bias  # the unfused chain: cuBLAS mm, then one eager op per epilogue step
        if "gelu" in sig:
            y = F.gelu(y)
        return y + res if "full1" in sig else y

    ours()
    ref = epi.reference(epi.parse(sig), epi.rows3(a.float() @ b.float(), (m, n), -1),
                        [epi.rows3(t.float(), (m, n), -1) for t in ops])
    err = rel_err(epi.rows3(out, out.shape, -1), ref)
    comp = compiled(eager, use_compile)
    nbytes = (a.numel() + b.numel() + out.numel() * (2 if "full1" in sig else 1)) * a.element_size()
    return {
        "kind": "gemm", "case": name, "batch": 32, "dtype": DNAME[dtype], "relerr": err,
        "ours_us": bench(ours), "eager_us": bench(eager), "compile_us": bench(comp) if comp else None,
        "alone_us": bench(lambda: torch.mm(a, b)),
        "ours_mainloop_us": bench(lambda: kernels.gemm(a, b, [], "acc", bare)),
        "floor_us": max(2 * m * n * k / peak, nbytes / bw) * 1e6,
        "bound": "mem" if nbytes / bw > 2 * m * n * k / peak else "math",
    }


def run_sweeps(peak, bw):
    from resfuse.kernels.conv2d_fprop import ConvConfig
    from resfuse.kernels.matmul import GemmConfig
    gemm_cfgs = [GemmConfig(128, 256, 64, 8, 1, 8, 3), GemmConfig(128, 128, 64, 8, 1, 4, 4),
                 GemmConfig(128, 128, 64, 8, 1, 8, 3), GemmConfig(256, 128, 64, 8, 1, 8, 3),
                 GemmConfig(128, 256, 64, 8, 1, 8, 4), GemmConfig(64, 256, 64, 8, 1, 4, 4)]
    conv_cfgs = [ConvConfig(128, 128, 64, 8, 1, False, 8, 3), ConvConfig(128, 64, 64, 8, 1, False, 4, 4),
                 ConvConfig(64, 128, 64, 8, 1, False, 4, 4), ConvConfig(128, 256, 64, 8, 1, False, 8, 3),
                 ConvConfig(256, 64, 64, 8, 1, False, 8, 3), ConvConfig(128, 128, 32, 8, 1, False, 4, 4)]
    # the TMA mainloop's twins (it reads the BERT GEMMs and the 1x1 convs; a 3x3 conv falls back to pointers)
    gemm_cfgs += [dataclasses.replace(c, tma=True) for c in gemm_cfgs]
    conv_cfgs += [dataclasses.replace(c, tma=True) for c in conv_cfgs[:4]]
    out = []
    for name, m, n, k, sig in BERT[:2]:
        out.append((name, sweep(lambda: gemm_row(name, m, n, k, "acc", torch.float16, peak, bw, False)["ours_us"],
                                "gemm_config", gemm_cfgs)))
    for case in (RESNET50[3], RESNET50[2], RESNET50[11]):
        out.append((case.name + " bs32", sweep(lambda: conv_row(case, 32, torch.float16, peak, bw, False)["ours_us"],
                                               "conv_config", conv_cfgs)))
    return out


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def table(rows) -> str:
    head = (f"{'case':24} {'bs':>3} {'dt':>4} {'relerr':>8} {'ours':>8} {'eager':>8} {'compile':>8} "
            f"{'alone':>8} {'floor':>7} {'o/floor':>7} {'o/eag':>6} {'o/comp':>6} {'o/alone':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        o = r["ours_us"]
        lines.append(
            f"{r['case'][:24]:24} {r['batch']:>3} {r['dtype'][:4]:>4} {r['relerr']:8.1e} {o:8.1f} "
            f"{r['eager_us']:8.1f} {fmt(r['compile_us']):>8} {r['alone_us']:8.1f} {r['floor_us']:7.1f} "
            f"{o / r['floor_us']:7.2f} {o / r['eager_us']:6.2f} "
            f"{fmt(r['compile_us'] and o / r['compile_us'], '.2f'):>6} {o / r['alone_us']:7.2f}"
            + (f"  mainloop {r['ours_mainloop_us']:.1f} = {r['ours_mainloop_us'] / r['alone_us']:.2f}x cuBLAS"
               if "ours_mainloop_us" in r else ""))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--only", default="conv,gemm")
    p.add_argument("--compile-dtypes", default="fp16", help="dtypes that also time torch.compile (slow to build)")
    p.add_argument("--cases", default="", help="substring filter on case names")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--timer", choices=sorted(TIMER), default="graph",
                   help="graph: CUDA-graph replays (device time, L2 warm); plain: do_bench (L2 flushed, launch "
                        "overhead included)")
    p.add_argument("--sweep", action="store_true", help="also time a few configs on key cases")
    args = p.parse_args(argv)
    global _timer
    _timer = TIMER[args.timer]
    torch._dynamo.config.cache_size_limit = 1024
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    peak, bw = measure_ceilings()
    header = (f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
              f"fp16 mm peak {peak / 1e12:.0f} TFLOP/s | copy {bw / 1e12:.2f} TB/s")
    print(header, flush=True)
    rows = []
    for dname in args.dtypes.split(","):
        dtype, use_compile = DTYPES[dname], dname in args.compile_dtypes.split(",")
        if "conv" in args.only:
            for n in map(int, args.batches.split(",")):
                for case in RESNET50:
                    if args.cases in case.name:
                        rows.append(conv_row(case, n, dtype, peak, bw, use_compile))
                        print(json.dumps(rows[-1]), flush=True)
        if "gemm" in args.only:
            for name, m, n, k, sig in BERT:
                if args.cases in name:
                    rows.append(gemm_row(name, m, n, k, sig, dtype, peak, bw, use_compile))
                    print(json.dumps(rows[-1]), flush=True)
    if args.sweep:
        rows_sweep = run_sweeps(peak, bw)
        print(json.dumps(rows_sweep), flush=True)
    else:
        rows_sweep = []
    text = (f"{header}\nwall {time.time() - t0:.0f} s; times in us, median, timer={args.timer}\n{table(rows)}"
            + "".join(f"\nsweep {name}: " + ", ".join(f"{c} {t:.1f}" for c, t in found) for name, found in rows_sweep))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "kernels.log"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
