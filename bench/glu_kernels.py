"""A gated MLP's up half, act(x Wg^T) * (x Wu^T), as one kernel against its peers (GPU).

  python bench/glu_kernels.py [--shapes tinyllama,llama7b] [--batch-tokens 3072] --out $OUT

Per shape ([T, K] tokens times a [2I, K] weight, fp16): eager (cuBLAS's GEMM of both halves, then silu and the
product, as HF's LlamaMLP runs), torch.compile of the same function (Inductor), cuBLAS's GEMM of both halves alone
(what any unfused peer pays before the epilogue), resfuse's GLU op (resfuse::gemm with the paired epilogue,
tuned here: our kernel or the next), cuBLAS's GEMM then our kernel of the pairing epilogue (the epilogue
provider), and our GEMM at the tuned config with no epilogue, writing the whole product (what the pairing costs).
GPU time a call (timing.gpu_us: 20 calls queued behind a sleep); error of each against float64.
Prints a table; JSON to $OUT/glu_kernels.json.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse  # noqa: E402,F401  (registers the ops)
from resfuse import kernels  # noqa: E402
from resfuse.bench import timing  # noqa: E402
from resfuse.ops.fused import call_of  # noqa: E402
from resfuse.config import Config  # noqa: E402
from resfuse.providers import epilogue as epilogue_provider  # noqa: E402
from resfuse.kernels import codegen  # noqa: E402
from resfuse.tuning import choose as tuner  # noqa: E402
from resfuse.tuning.choose import choose  # noqa: E402

SHAPES = {"tinyllama": (2048, 5632), "llama7b": (4096, 11008), "llama3-8b": (4096, 14336)}  # (hidden, intermediate)
SIG = "mul(silu(acc),up)"


def eager(x, w):
    g, u = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(g) * u


def _dump_ir(out_dir, name):
    """The Triton GPU IR (ttgir) and PTX of every paired kernel compiled so far, to read where the pairing's split
    of the accumulator lands (a layout conversion inside the loop would cost the whole reduction)."""
    for (family, variant), fn in codegen._LOADED.items():
        if "up" not in variant:
            continue
        for cache in getattr(fn, "device_caches", {}).values():
            for i, compiled in enumerate(cache[0].values()):
                for kind in ("ttgir", "ptx"):
                    with open(os.path.join(out_dir, f"glu_{name}_{family}_{i}.{kind}"), "w") as f:
                        f.write(compiled.asm.get(kind, ""))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="tinyllama,llama7b")
    p.add_argument("--batch-tokens", type=int, default=3072)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    cfg = Config.from_env()
    tuner.configure(cfg.tuning, cfg.cache_dir, cfg.tuning_budget_s, cfg.retune)
    rows = []
    for name in args.shapes.split(","):
        hidden, inter = SHAPES[name]
        t = args.batch_tokens
        x = torch.randn(t, hidden, device="cuda", dtype=torch.float16)
        w = (torch.randn(2 * inter, hidden, device="cuda") / hidden ** 0.5).half()  # [gate; up], as merge_linears
        wi = w.view(2, inter, hidden).transpose(0, 1).reshape(2 * inter, hidden)  # interleaved, as passes/glu.py
        sets = [(x, w)]
        acc = x.double() @ w.double().t()
        ref = F.silu(acc[:, :inter]) * acc[:, inter:]
        compiled = torch.compile(eager)
        glu = lambda x, w: torch.ops.resfuse.gemm(x, wi.t(), [], SIG, [t, inter], "triton")  # noqa: E731
        with torch.no_grad():
            glu(x, w)  # tunes
        call = call_of("gemm", (x, wi.t()), [], SIG, ([t, inter],))
        choice = choose(call)
        wide = torch.empty(t, 2 * inter, device="cuda", dtype=torch.float16)
        bare = lambda x, w: kernels.gemm(x, wi.t(), [], "acc", wide, choice.config)  # noqa: E731
        peers = {"eager": eager, "torch.compile": compiled, "cuBLAS GEMM alone": lambda x, w: F.linear(x, w),
                 "resfuse GLU": glu, "cuBLAS + our pair kernel": lambda x, w: epilogue_provider.run(call)}
        if choice.provider == "triton":
            peers["ours, no epilogue"] = bare
        row = {"shape": name, "tokens": t, "hidden": hidden, "inter": inter,
               "choice": [choice.provider, str(choice.config)], "us": {}, "err": {}}
        for peer, fn in peers.items():
            with torch.no_grad():
                out = fn(x, w)
                row["us"][peer] = timing.gpu_us(fn, sets)
            if peer != "ours, no epilogue" and peer != "cuBLAS GEMM alone":
                row["err"][peer] = ((out.double() - ref).norm() / ref.norm()).item()
        flops = 2 * t * hidden * 2 * inter
        row["tflops_glu"] = flops / row["us"]["resfuse GLU"] / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
        _dump_ir(args.out, name)
    with open(os.path.join(args.out, "glu_kernels.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'shape':<10} {'peer':<20} {'GPU us':>9} {'vs eager':>9} {'rel err':>9}")
    for row in rows:
        for peer, us in row["us"].items():
            err = row["err"].get(peer)
            print(f"{row['shape']:<10} {peer:<20} {us:9.1f} {row['us']['eager'] / us:8.2f}x "
                  f"{'' if err is None else f'{err:9.1e}'}")
        print(f"{row['shape']:<10} resfuse's choice: {row['choice']}; {row['tflops_glu']:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
