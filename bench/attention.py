"""Which SDPA backend is fastest on the attention shapes of the zoo's transformers (GPU machine).

Entry point: `python bench/attention.py [--out DIR]`. For each shape, q/k/v are laid out as HF transformers
lays them out (a [B, S, H*D] projection viewed as [B, H, S, D]); each backend that accepts them is timed
forward, and forward + backward, by CUDA-graph replay (the tuner's timer), and its output is compared with
the math backend's in fp32. torch picks among the fused backends by a fixed priority; this shows what that
priority costs on this GPU. Prints a table; writes attention.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from resfuse.tuning.choose import _bench  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}
SHAPES = {  # name: (batch, seq, heads, head_dim)
    "bert bs32 seq384": (32, 384, 12, 64), "bert bs1 seq384": (1, 384, 12, 64),
    "bert bs256 seq384": (256, 384, 12, 64), "bert-train bs32 seq128": (32, 128, 12, 64),
    "vit bs32 seq197": (32, 197, 12, 64), "vit bs256 seq197": (256, 197, 12, 64),
}


def qkv(b, s, h, d, grad):
    def one():
        return (torch.randn(b, s, h * d, device="cuda", dtype=torch.float16)
                .view(b, s, h, d).transpose(1, 2).requires_grad_(grad))
    return one(), one(), one()


def measure(name, shape) -> list[dict]:
    rows = []
    q, k, v = qkv(*shape, grad=False)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    for backend, which in [("default", None), *BACKENDS.items()]:
        row = {"shape": name, "backend": backend}
        try:
            ctx = sdpa_kernel([which]) if which is not None else contextlib.nullcontext()
            with ctx:
                out = F.scaled_dot_product_attention(q, k, v)
                row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                row["fwd_us"] = _bench(lambda: F.scaled_dot_product_attention(q, k, v)) * 1e6
                qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
                grad = torch.randn_like(out)

                def step():
                    o = F.scaled_dot_product_attention(qg, kg, vg)
                    torch.autograd.grad(o, (qg, kg, vg), grad)
                row["fwd_bwd_us"] = _bench(step) * 1e6
        except Exception as e:  # a backend that refuses these tensors is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        b, s, h, d = shape
        if "fwd_us" in row:
            row["fwd_tflops"] = 4 * b * h * s * s * d / row["fwd_us"] / 1e6
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    opts = parser.parse_args()
    rows = [r for name, shape in SHAPES.items() for r in measure(name, shape)]
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    (Path(opts.out) / "attention.json").write_text(json.dumps(rows, indent=1))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':<24}{'backend':<11}{'fwd us':>9}{'TFLOP/s':>9}{'fwd+bwd us':>12}{'rel err':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<24}{r['backend']:<11}  {r['error']}")
            continue
        print(f"{r['shape']:<24}{r['backend']:<11}{r['fwd_us']:>9.1f}{r['fwd_tflops']:>9.0f}"
              f"{r.get('fwd_bwd_us', float('nan')):>12.1f}{r['rel_err']:>10.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
