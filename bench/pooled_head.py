"""GPU probe: a classifier's head (global average pool, then the linear layer) as one kernel
(kernels/pooled_matmul.py) against the pool and the linear layer as two ops: eager's (mean, then addmm) and
torch.compile's (Inductor's pool kernel, then its addmm), each timed by CUDA-graph replay (the tuner's timer), hot
(the weight in L2, as the tuner times) and cold (a rotation of weight copies spanning three L2s, as in a model whose
weights outgrow L2: bench/small_m.py's --cold).

  python bench/pooled_head.py [--heads rn50,rn18,effb0,regnety] [--batches 1,2,8] [--sweep] [--out DIR]

fp16; x channels_last. Each case times kernels/pooled_matmul.fast_configs (the default among them), and with
--sweep also the product SWEEP with the default's block_m (about 190 compiles a case). Rows print as measured;
all go to DIR/pooled_head.json, and a table of each case's best per form prints last.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse.kernels import pooled_matmul as pm  # noqa: E402
from resfuse.tuning.choose import _bench  # noqa: E402
from small_m import cold_bench  # noqa: E402

SWEEP = {"block_n": (16, 32, 64, 128), "block_k": (32, 64, 128), "block_p": (16, 64), "split_k": (2, 4, 8, 16),
         "num_warps": (4, 8), "num_stages": (2,)}  # --sweep: the default's block_m with each of these
HEADS = {"rn50": (2048, 7, 1000), "rn18": (512, 7, 1000), "effb0": (1280, 7, 1000), "regnety": (1088, 7, 1000)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", default="rn50,rn18,effb0,regnety")
    p.add_argument("--batches", default="1,2,8")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    rows = []
    for head, batch in itertools.product(args.heads.split(","), [int(b) for b in args.batches.split(",")]):
        c, side, n = HEADS[head]
        x = torch.randn(batch, c, side, side, device="cuda").half().contiguous(memory_format=torch.channels_last)
        w = (torch.randn(n, c, device="cuda") / c ** 0.5).half()
        bias = torch.randn(n, device="cuda").half()
        ref = F.linear(x.float().mean((2, 3)).half().float(), w.float(), bias.float())
        out = torch.empty(batch, n, device="cuda", dtype=torch.float16)
        compiled = torch.compile(lambda x, w: F.linear(x.mean((2, 3)), w, bias))
        forms = {"eager": lambda wc: F.linear(x.mean((2, 3)), wc, bias),
                 "compile": lambda wc: compiled(x, wc)}
        prob = pm.PooledProblem(batch, c, n, side * side, 2, torch.cuda.get_device_properties(0).multi_processor_count)
        space = pm.fast_configs(prob) + ([pm.PooledConfig(pm.default_config(prob).block_m, *v) for v in
                                          itertools.product(*SWEEP.values())] if args.sweep else [])
        for cfg in [c for c in space if c.check(prob)]:
            forms[f"ours {dataclasses.astuple(cfg)}"] = (
                lambda wc, cfg=cfg: pm.pooled_gemm(x, wc.t(), [bias], "add(acc,c0)", out, cfg))
        for name, run in forms.items():
            row = {"head": head, "batch": batch, "form": name}
            try:
                out.fill_(float("nan"))
                got = run(w)
                row["rel_err"] = ((got.float() - ref).norm() / ref.norm()).item()
                row["us"] = _bench(lambda: run(w)) * 1e6
                row["cold_us"] = cold_bench(run, w)[0] * 1e6
            except Exception as e:  # noqa: BLE001 - a form that fails is a row
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(row, flush=True)
        with open(os.path.join(args.out, "pooled_head.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'head':8s}{'bs':>4s}  {'eager hot/cold':>16s}  {'compile hot/cold':>18s}  "
          f"{'ours best hot/cold':>20s}  ours best (cold)")
    for (head, batch), group in itertools.groupby(rows, key=lambda r: (r["head"], r["batch"])):
        group = [r for r in group if "cold_us" in r]
        by = {r["form"]: r for r in group}
        ours = [r for r in group if r["form"].startswith("ours")]
        best = min(ours, key=lambda r: r["cold_us"]) if ours else None
        def cell(r):
            return f"{r['us']:.2f}/{r['cold_us']:.2f}" if r else "-"
        print(f"{head:8s}{batch:4d}  {cell(by.get('eager')):>16s}  {cell(by.get('compile')):>18s}  {cell(best):>20s}  "
              f"{best['form'] if best else ''}")


if __name__ == "__main__":
    main()
