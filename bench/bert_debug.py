"""Why BERT under resfuse is slow and why some of its GEMMs find no correct candidate (GPU machine).

Entry point: `python bench/bert_debug.py [--batch 32 --seq 384]`. Prints (1) the op histogram of the ATen
inference graph aot_autograd hands a backend (which attention op the trace chose), (2) for every fused-op
call whose tuning finds no correct candidate: its input/reference statistics, and (3) timings of eager,
aot_eager and resfuse in one run.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402
from resfuse.tuning import choose, select  # noqa: E402


def histogram(model, inputs):
    from torch._dynamo.backends.common import aot_autograd

    seen = collections.Counter()

    def count(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function":
                v = n.meta.get("val")
                seen[(str(n.target), str(getattr(v, "dtype", "")))] += 1
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=count, inference_compiler=count))(*inputs)
    for (op, dt), k in sorted(seen.items(), key=lambda kv: -kv[1]):
        print(f"{k:5d}  {op:60s} {dt}")


def stats(name, t):
    t64 = t.double()
    fin = torch.isfinite(t64)
    print(f"    {name:10s} {tuple(t.shape)} {tuple(t.stride())} {t.dtype} finite {fin.float().mean():.4f} "
          f"absmax {t64[fin].abs().max() if fin.any() else float('nan'):.3g} norm {t64.nan_to_num().norm():.4g}")


def sdpa_ops():
    """Which attention op aot_autograd's trace keeps for a plain SDPA call, without and with a mask like HF's."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(2, 12, 384, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    keep = torch.ones(2, 1, 1, 384, device="cuda", dtype=torch.bool).expand(2, 1, 384, 384)
    masks = {"none": None, "bool expanded": keep,
             "fp16 where": torch.where(keep, torch.tensor(0.0, dtype=torch.float16, device="cuda"),
                                       torch.tensor(float("-inf"), dtype=torch.float16, device="cuda"))}
    for name, mask in masks.items():
        print(f"-- sdpa, mask {name}: eager choice {torch._fused_sdp_choice(q, k, v, mask)}")
        histogram(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v))


def instrument():
    real = choose.tune
    real_wrong = select._wrong

    def wrong(out, reference, tol):
        why = real_wrong(out, reference, tol)
        if why:
            print(f"    check: out norm {out.double().norm():.4g} ref norm {reference.double().norm():.4g} "
                  f"capturing {torch.cuda.is_current_stream_capturing()} stream {torch.cuda.current_stream()}")
        return why

    select._wrong = wrong

    def tune(call, **kw):
        print(f"  tuning {call.op} {call.signature}: inputs' norms "
              f"{[round(t.double().norm().item(), 1) for t in call.inputs]} capturing "
              f"{torch.cuda.is_current_stream_capturing()} stream {torch.cuda.current_stream()}")
        entry = real(call, **kw)
        if entry is None:
            print(f"  no correct candidate: {call.op} {call.signature} params {call.params}")
            for i, t in enumerate(call.inputs):
                stats(f"input{i}", t)
            for i, t in enumerate(call.operands):
                stats(f"operand{i}", t)
            ref = choose._reference(call)
            stats("reference", ref)
            from resfuse.providers import aten
            out = aten.run(call, call.out.empty())
            stats("aten fp16", out)
            diff = (out.double() - ref.double())
            idx = diff.abs().nan_to_num().argmax()
            print(f"    worst at flat {int(idx)}: aten {out.flatten()[idx].item()} ref {ref.flatten()[idx].item()}")
        return entry

    choose.tune = tune


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=384)
    args = p.parse_args()
    model, inputs = models.load("hf-bert-base", args.batch, torch.float16, torch.device("cuda"), seq=args.seq)
    sdpa_ops()
    print("== inference graph ops (aot_autograd)")
    histogram(model, inputs)
    instrument()
    sets = timing.input_sets(inputs)
    rows = []
    with torch.no_grad():
        ref = model(*inputs)
        for name, fn in [("eager", model), ("aot_eager", torch.compile(model, backend="aot_eager")),
                         ("resfuse", resfuse.compile(model))]:
            out = fn(*inputs)
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            ms = timing.latency(fn, sets, torch.device("cuda"), iters=30).median_ms
            rows.append((name, ms, err))
    for r in rows:
        print(f"{r[0]:12s} {r[1]:8.3f} ms  relerr {r[2]:.2e}")


if __name__ == "__main__":
    main()
