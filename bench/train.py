"""Training-step benchmark (issue 6), GPU machine: eager, torch.compile (default and
reduce-overhead) and resfuse (with and without CUDA graphs) in one run.

Entry point: `python bench/train.py [--jobs resnet50:64,resnet50:256,bert:32,resnext50:64] [--peers eager,compile,...]
[--iters 20] [--out DIR]`.
ResNet-50 (torchvision) trains in fp16 autocast, channels_last; BERT-base (HF, seq 128) likewise. Each
peer starts from the same weights: one step's gradients are compared with eager's (the largest relative
error over parameters), then the step (forward, loss, backward, SGD) is timed with CUDA events: the median
of steps each started on an idle GPU ("ms"), and the mean of steps run back to back as a training loop runs
them ("loop ms": the host's work before a step's first kernel then overlaps the previous step), and its peak memory read from torch.cuda.max_memory_allocated and max_memory_reserved (a CUDA-graph
replay allocates nothing; its memory is its private pool, which only the reserved figure counts). resfuse
runs with FuseAddToOutput on and off to show what the pass does to memory. Writes train.json after every
job and prints a table last.
"""
from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse  # noqa: E402


def resnet50(batch: int, arch: str = "resnet50"):
    import torchvision

    model = getattr(torchvision.models, arch)().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    return model, (x, y), lambda out, y: torch.nn.functional.cross_entropy(out, y)


def bert(batch: int):
    import transformers

    config = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(config).cuda()
    x = torch.randint(0, config.vocab_size, (batch, 128), device="cuda")
    y = torch.randint(0, 2, (batch,), device="cuda")
    return _Logits(model), (x, y), lambda out, y: torch.nn.functional.cross_entropy(out, y)


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).logits


MODELS = {"resnet50": resnet50, "bert": bert,
          "resnext50": lambda batch: resnet50(batch, "resnext50_32x4d")}  # grouped convs and their data gradients


def peers():
    return {
        "eager": lambda m: m,
        "compile": lambda m: torch.compile(m),
        "reduce-overhead": lambda m: torch.compile(m, mode="reduce-overhead"),
        "resfuse": lambda m: resfuse.compile(m),  # training: no CUDA graphs unless asked
        "resfuse+graphs": lambda m: resfuse.compile(m, cuda_graphs=True),
        "resfuse-no-ato": lambda m: resfuse.compile(m, fuse_add_to_output=False),
        "resfuse+graphs-no-ato": lambda m: resfuse.compile(m, cuda_graphs=True, fuse_add_to_output=False),
        "resfuse+graphs-eager-rest": lambda m: resfuse.compile(m, cuda_graphs=True, remainder="eager"),
        "resfuse+graphs-no-pdl": lambda m: resfuse.compile(m, cuda_graphs=True, pdl=False),
        "resfuse+graphs-no-conv-stats": lambda m: resfuse.compile(m, cuda_graphs=True, conv_stats=False),
        "resfuse+graphs+combo": lambda m: resfuse.compile(m, cuda_graphs=True, combo_kernels=True),
        "resfuse+graphs-no-pad": lambda m: resfuse.compile(m, cuda_graphs=True, pad_channels=False),
        "resfuse+graphs-no-sums": lambda m: resfuse.compile(m, cuda_graphs=True, bn_backward_sums=False),
        "resfuse+graphs-sums": lambda m: resfuse.compile(m, cuda_graphs=True, bn_backward_sums=True),
        "resfuse+graphs-no-pdl-no-sums": lambda m: resfuse.compile(m, cuda_graphs=True, pdl=False,
                                                                    bn_backward_sums=False),
    }


def step_fn(model, opt, loss_fn, data):
    x, y = data

    def step():
        torch.compiler.cudagraph_mark_step_begin()  # a new iteration for the CUDA-graph peers; no-op elsewhere
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def step_ms(step, iters: int) -> float:
    """Median CUDA-event time of one step, each started on an idle GPU."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def loop_ms(step, iters: int) -> float:
    """CUDA-event time of `iters` steps run back to back, as a training loop runs them (no sync between steps,
    so the host's work before a step's first kernel overlaps the previous step's kernels), per step."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(iters):
        step()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def grads_of(model, data, loss_fn):
    x, y = data
    torch.compiler.cudagraph_mark_step_begin()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    loss.backward()
    return {n.removeprefix("_orig_mod."): p.grad.detach().float().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def top_kernels(step, n: int = 25) -> list:
    """Every CUDA kernel of the step by total time, and the n busiest host (CPU) ops, per step. With PDL on, a
    kernel's time includes its wait for the one before it, so the sum over kernels exceeds the step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    kernels = sorted((e for e in averages if e.device_time_total > 0 and e.self_device_time_total > 0),
                     key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels) / 3
    rows = [{"us": e.self_device_time_total / 3, "calls": e.count // 3, "name": e.key[:100]} for e in kernels]
    host = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:n]
    rows += [{"host_us": e.self_cpu_time_total / 3, "calls": e.count // 3, "name": e.key[:100]} for e in host]
    return [{"device_us_per_step": total}] + rows


def run_job(name: str, batch: int, iters: int, profile: bool = False, only=()) -> dict:
    torch.manual_seed(0)
    base, data, loss_fn = MODELS[name](batch)
    rows = {}
    ref_grads = None
    for peer in only or peers():
        wrap = peers()[peer]
        if peer in rows:  # a peer named again (an A/B repeated): its own row
            peer = f"{peer} #{sum(p.split(' #')[0] == peer for p in rows) + 1}"
        torch._dynamo.reset()
        model = copy.deepcopy(base).train()
        compiled = wrap(model)
        row = {}
        try:
            t0 = time.perf_counter()
            grads = grads_of(compiled, data, loss_fn)  # first call: capture, compile, tune
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            if ref_grads is None:
                ref_grads = grads
            # all gradients as one vector: per-parameter ratios of fp16-AMP noise on near-zero grads mean nothing
            diff = torch.cat([(grads[k] - g).flatten() for k, g in ref_grads.items()])
            row["grad_relerr"] = (diff.norm() / torch.cat([g.flatten() for g in ref_grads.values()]).norm()).item()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
            step = step_fn(compiled, opt, loss_fn, data)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            gc.collect()  # tuning's leftovers (CUDA graphs and their pools) are not the step's memory
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            row["ms"] = step_ms(step, iters)
            row["loop_ms"] = loop_ms(step, iters)
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            # a CUDA-graph replay allocates nothing: its memory is the private pool, counted as reserved
            row["reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
            report = getattr(compiled, "resfuse_report", None)
            if report is not None:
                row["fusions"] = {g: sum(f.graph == g for f in report.fusions) for g in ("forward", "backward")}
                row["adds_fused"] = {g: sum(f.graph == g and "add" in f.ops for f in report.fusions)
                                     for g in ("forward", "backward")}
                row["errors"] = report.errors
                row["rewrites"] = report.rewrites
                row["paths"] = sorted({f"{f.anchor}:{f.ran}" for f in report.fusions})
                reasons = collections.Counter(f"{r.graph}: {r.reason[:90]}" for r in report.rejected
                                              if "add" in r.op)
                row["adds_not_fused"] = dict(reasons.most_common(6))
            if profile:
                row["top_kernels"] = top_kernels(step)
        except Exception as e:  # one peer failing must not hide the others' numbers
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        rows[peer] = row
        print(f"{name} bs{batch} {peer}: {json.dumps(row, indent=1)}", flush=True)
        del compiled, model
        torch._dynamo.reset()  # also frees the CUDA graph trees and their pools
        gc.collect()
        torch.cuda.empty_cache()
    return {"model": name, "batch": batch, "device": torch.cuda.get_device_name(), "peers": rows}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", default="resnet50:64,resnet50:256,bert:32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="top CUDA kernels and host ops of each peer's step")
    p.add_argument("--peers", default="", help="comma list of peers to run, in this order, a name given twice runs "
                   "twice (default all; the first peer's gradients are the reference)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    results = []
    for job in args.jobs.split(","):
        name, batch = job.split(":")
        only = tuple(p for p in args.peers.split(",") if p)
        results.append(run_job(name, int(batch), args.iters, args.profile, only))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "train.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'job':16s} {'peer':22s} {'ms':>9s} {'vs compile':>10s} {'loop ms':>8s} {'vs compile':>10s} "
          f"{'peak GB':>8s} {'reserved':>8s} {'grad err':>9s} first s")
    for r in results:
        base = r["peers"].get("compile", {}).get("ms")
        loop_base = r["peers"].get("compile", {}).get("loop_ms")
        for peer, row in r["peers"].items():
            if "ms" not in row:
                print(f"{r['model']}:{r['batch']:<10} {peer:22s} {row.get('error', '?')[:80]}")
                continue
            speed = f"{base / row['ms']:.2f}x" if base else "-"
            loop_speed = f"{loop_base / row['loop_ms']:.2f}x" if loop_base else "-"
            print(f"{r['model']}:{r['batch']:<10} {peer:22s} {row['ms']:9.2f} {speed:>10s} {row['loop_ms']:8.2f} "
                  f"{loop_speed:>10s} {row['peak_gb']:8.2f} "
                  f"{row['reserved_gb']:8.2f} {row['grad_relerr']:9.1e} {row['first_call_s']:.0f}")


if __name__ == "__main__":
    main()
