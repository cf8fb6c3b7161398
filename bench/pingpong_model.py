"""GPU probe: a model end to end with bench/pingpong.py's Gluon ping-pong kernel in place of resfuse's Triton GEMM
for its GELU GEMMs (BERT's FFN1), against the same model without it, in one process.

Entry point: `python bench/pingpong_model.py --model hf-bert-base --batch 32 [--iters 50] [--out DIR]`, on a Hopper
GPU. Steps:
1. resfuse.compile(model) with its defaults (CUDA graphs); the first call tunes, as the product does; latency.
2. `resfuse.kernels.gemm` patched: an fp16 GEMM whose epilogue is gelu(add(acc,c0)), with an nn.Linear weight and
   contiguous rows, runs the ping-pong kernel (pingpong.CONFIGS[0]) instead; the graph is compiled again
   (torch._dynamo.reset; the tuner's choices come from its cache), latency.
3. Unpatched again, to bracket the drift between steps.
Only ops whose tuned provider is resfuse's Triton kernel reach the patch: the script prints how many GEMMs it
took at capture. Every variant's output is compared with eager's. Writes DIR/pingpong_model.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import pingpong  # noqa: E402
import resfuse  # noqa: E402
from resfuse import kernels  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402

GELU = "gelu(add(acc,c0))"


def patched_gemm(original, taken: list, sms: int):
    def gemm(a, b, operands, signature, out, config=None, aux=None):
        k, n = a.shape[-1], b.shape[-1]
        if (signature == GELU and aux is None and a.dtype == torch.float16 and b.dim() == 2 and b.t().is_contiguous()
                and a.is_contiguous() and out.is_contiguous() and operands[0].numel() == n):
            pingpong.launcher(a.reshape(-1, k), b.t(), operands[0].reshape(n), None, out.view(-1, n),
                              pingpong.EPI_GELU, pingpong.CONFIGS[0], sms)()
            taken.append(tuple(a.shape))
            return out
        return original(a, b, operands, signature, out, config, aux)
    return gemm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="hf-bert-base")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    model, example = models.load(args.model, args.batch, torch.float16, "cuda")
    reference = timing.run_once(model, example)
    original, taken = kernels.gemm, []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, gemm in [("resfuse", original), ("resfuse + ping-pong FFN1", patched_gemm(original, taken, sms)),
                       ("resfuse again", original)]:
        kernels.gemm = gemm
        torch._dynamo.reset()
        compiled = resfuse.compile(model)
        taken.clear()
        err, _ = timing.output_error(timing.run_once(compiled, example), reference)
        with torch.no_grad():
            ms = timing.latency(compiled, [example], example[0].device, args.iters, warmup=5).median_ms
        rows.append({"variant": name, "ms": ms, "rel_err": err, "ping_pong_gemms_at_capture": len(taken)})
        print(f"{name:28} {ms:8.3f} ms  rel err {err:.1e}  ping-pong GEMMs taken at capture {len(taken)}", flush=True)
    kernels.gemm = original
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pingpong_model.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "batch": args.batch, "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
