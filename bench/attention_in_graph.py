"""Why attention runs slower inside resfuse's compiled graphs than in eager (GPU machine; a debugging aid).

Entry point: `python bench/attention_in_graph.py [--model hf-vit-base --batch 256]`. The zoo's profiles showed
cuDNN's SDPA kernel taking 573 us a call in resfuse's ViT-B bs256 graph against 179 us in eager (BERT bs32: 86
against 44 in bench/attention.py). This compiles the model with resfuse (no tuning: the GEMM choices do not
matter here) with the remainder eager and through Inductor, prints the ATen SDPA call each graph makes (op,
argument shapes, strides, flags), and the device time of the attention kernels per call in each variant.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse  # noqa: E402
from resfuse.bench import models  # noqa: E402
from resfuse.capture import backend  # noqa: E402


def show_sdpa(gm, graph):
    for n in gm.graph.nodes:
        if n.op == "call_function" and "scaled_dot_product" in str(n.target):
            def meta(a):
                v = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
                return f"T{tuple(v.shape)} s{v.stride()} {v.dtype}" if isinstance(v, torch.Tensor) else repr(v)
            print(f"  [{graph}] {n.target}({', '.join(meta(a) for a in n.args)}; {n.kwargs})", flush=True)
            out = n.meta.get("val")
            if isinstance(out, (tuple, list)) and isinstance(out[0], torch.Tensor):
                print(f"    out T{tuple(out[0].shape)} s{out[0].stride()}", flush=True)
            break


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def attention_us(fn, x, iters=5) -> tuple[float, int, str]:
    with torch.no_grad():
        for _ in range(2):
            fn(x)
        sync()
        with profile(activities=[ProfilerActivity.CUDA if x.is_cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(iters):
                fn(x)
            sync()
    rows = [e for e in prof.key_averages() if "sdpa" in e.key or "attention" in e.key or "fmha" in e.key]
    total = sum(e.device_time_total or e.cpu_time_total for e in rows)
    calls = sum(e.count for e in rows)
    return total / max(calls, 1), calls // iters, ", ".join(e.key[:60] for e in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="hf-vit-base")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model, (x,) = models.load(args.model, args.batch, dtype, device, seq=384)
    real = backend.build

    def spy(gm, example_inputs, config, graph, report):
        show_sdpa(gm, graph)
        return real(gm, example_inputs, config, graph, report)

    backend.build = spy
    variants = {"eager": lambda: model,
                "rf remainder=eager": lambda: resfuse.compile(model, tuning="none", remainder="eager"),
                "rf remainder=inductor": lambda: resfuse.compile(model, tuning="none", remainder="inductor"),
                "rf+graphs remainder=inductor": lambda: resfuse.compile(model, tuning="none", cuda_graphs=True)}
    for name, make in variants.items():
        torch._dynamo.reset()
        print(f"{name}:", flush=True)
        us, per_call, keys = attention_us(make(), x)
        print(f"  attention {us:.1f} us a call, {per_call} calls a forward ({keys})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
