"""GPU sweep: the persistent TMA GEMM kernel against the one-tile-per-program TMA kernel, on the GEMM-shaped
ops whose epilogue stores dominate (ConvNeXt-T's pointwise layers and ResNet-50's 1x1 convs at bs256, BERT's
FFN).

Entry point: `python bench/persistent.py [--cases SUBSTR] [--sigs "SIG;SIG"] [--stores] [--out DIR]`, on a GPU
machine. For each case it times (CUDA-graph replays, median) each config of a small list, checks every result
against an fp32 reference, and prints per case the best one-tile-per-program config, the best persistent one,
cuBLAS/cuDNN alone, the unfused eager chain and the roofline floor. With --stores, each config runs twice, its
output written by per-thread stores, then by bulk TMA stores (kernels option tma_store), and a second table
compares the two per case. Rows go to DIR/persistent.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import kernels as kb  # noqa: E402  bench/kernels.py: the case builders, the timer and the ceilings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import epilogue as epi, kernels  # noqa: E402
from resfuse.kernels.conv2d_fprop import ConvConfig  # noqa: E402
from resfuse.kernels.matmul import GemmConfig  # noqa: E402

# (name, M, N, K, signature): timm ConvNeXt-T's pointwise Linear layers at bs256 (NHWC rows), BERT-base's FFN
GEMMS = [
    ("convnext s1 pw1 96>384 gelu", 256 * 56 * 56, 384, 96, "gelu(add(acc,c0))"),
    ("convnext s1 pw2 384>96 +res", 256 * 56 * 56, 96, 384, "add(add(acc,c0),full1)"),
    ("convnext s2 pw1 192>768 gelu", 256 * 28 * 28, 768, 192, "gelu(add(acc,c0))"),
    ("convnext s2 pw2 768>192 +res", 256 * 28 * 28, 192, 768, "add(add(acc,c0),full1)"),
    ("convnext s3 pw1 384>1536 gelu", 256 * 14 * 14, 1536, 384, "gelu(add(acc,c0))"),
    ("bert ffn1 768>3072 gelu", 12288, 3072, 768, "gelu(add(acc,c0))"),
]
CONVS = [c for c in kb.RESNET50 if c.r == 1]  # ResNet-50's 1x1 convs, run at bs256

# (block_m, block_n, block_k, num_warps, num_stages)
TILES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4),
         (128, 64, 64, 4, 4), (128, 128, 32, 8, 4)]


def configs(cls, k: int) -> list:
    found = []
    for bm, bn, bk, nw, ns in TILES:
        if bk > k:
            continue
        base = cls(block_m=bm, block_n=bn, block_k=bk, group_m=8, split_k=1, num_warps=nw, num_stages=ns, tma=True)
        found += [base] + [dataclasses.replace(base, persistent=p) for p in (1, 2)]
    return found


def best(timed, persistent: bool):
    rows = [(cfg, us) for cfg, us in timed if (cfg.persistent > 0) == persistent]
    return min(rows, key=lambda r: r[1]) if rows else (None, float("nan"))


def gemm_tensors(case) -> dict:
    """A Linear-layer GEMM case's inputs (a [M, K], wt nn.Linear's [N, K] weight, bias, res), its epilogue operands
    `ops`, its output `out` and the fp32 reference `ref` (both as [1, M, N] rows)."""
    name, m, n, k, sig = case
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    wt = torch.randn(n, k, device="cuda", dtype=torch.float16) / k**0.5
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    res = torch.randn(m, n, device="cuda", dtype=torch.float16)
    ops = [bias, res][: 2 if "full1" in sig else 1 if "c0" in sig else 0]
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    ref = epi.reference(epi.parse(sig), epi.rows3(a.float() @ wt.t().float(), (m, n), -1),
                        [epi.rows3(t.float(), (m, n), -1) for t in ops])
    return dict(a=a, wt=wt, bias=bias, res=res, ops=ops, out=out, ref=ref)


def gemm_case(case, t: dict | None = None):
    """(name, K, ours(cfg), fp32 reference, out, eager, alone, minimal bytes, flops) for a Linear-layer GEMM, on
    gemm_tensors(case) or the given ones."""
    name, m, n, k, sig = case
    t = t or gemm_tensors(case)
    a, wt, bias, res, out = t["a"], t["wt"], t["bias"], t["res"], t["out"]

    def eager():
        y = F.linear(a, wt, bias)
        y = F.gelu(y) if "gelu" in sig else y + res if "full1" in sig else y
        return torch.relu(y) if sig.startswith("relu") else y

    nbytes = (a.numel() + wt.numel() + out.numel() * (2 if "full1" in sig else 1)) * 2
    return (name, k, lambda cfg: kernels.gemm(a, wt.t(), t["ops"], sig, out, cfg), epi.rows3(out, out.shape, -1),
            t["ref"], eager, lambda: torch.mm(a, wt.t()), nbytes, 2 * m * n * k)


def conv_case(case):
    """The same for one of ResNet-50's 1x1 convs at bs256 with its folded batch norm (+ residual) + relu."""
    cl, n = torch.channels_last, 256
    x = torch.randn(n, case.c, case.hw, case.hw, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    w = (torch.randn(case.k, case.c, 1, 1, device="cuda", dtype=torch.float16) / case.c**0.5)
    w = w.contiguous(memory_format=cl)
    shape = [n, case.k, case.hw, case.hw]
    mean, wgt, bias = (torch.randn(case.k, device="cuda") for _ in range(3))
    var = torch.rand(case.k, device="cuda") + 0.5
    res = torch.randn(shape, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    sig = kb.BN_ADD_RELU if case.tail else kb.BN_RELU
    ops = [t.view(-1, 1, 1) for t in (mean, var, wgt, bias)] + ([res] if case.tail else [])
    out = torch.empty(shape, device="cuda", dtype=torch.float16).contiguous(memory_format=cl)
    acc = F.conv2d(x.float(), w.float())
    ref = epi.reference(epi.parse(sig), epi.rows3(acc, acc.shape, 1), [epi.rows3(t.float(), acc.shape, 1) for t in ops])

    def eager():
        y = F.batch_norm(F.conv2d(x, w), mean, var, wgt, bias, False, 0.0, 1e-5)
        return torch.relu(y + res) if case.tail else torch.relu(y)

    nbytes = (x.numel() + w.numel() + out.numel() * (2 if case.tail else 1)) * 2
    return (case.name + " bs256", case.c, lambda cfg: kernels.conv2d(x, w, ops, sig, [1, 1], [0, 0], [1, 1], out, cfg),
            epi.rows3(out, out.shape, 1), ref, eager, lambda: F.conv2d(x, w), nbytes, 2 * out.numel() * case.c)


def run_case(built, cls, peak: float, bw: float, stores=(True,)) -> dict:
    """Time each config with each output store in `stores` (True: bulk TMA stores where the kernel can)."""
    name, k, ours, out, ref, eager, alone, nbytes, flops = built
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    timed, errs, by_store = [], [], {}
    for cfg in configs(cls, k):
        for store in stores:
            kernels.set_options(tma_store=store)
            try:
                out.fill_(float("nan"))
                ours(cfg)
                errs.append(kb.rel_err(out, ref))
                us = kb.bench(lambda: ours(cfg))
            except Exception as e:  # a config that fails to compile is reported, not fatal to the sweep
                print(f"  {name}: {cfg} store {store} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            by_store.setdefault(str(cfg), {})[store] = us
            if store == stores[-1]:
                timed.append((cfg, us))
            print(f"  {name}: {cfg} tma_store={store} {us:.1f} us, err {errs[-1]:.1e}", flush=True)
    kernels.set_options(tma_store=True)
    (tile_cfg, tile_us), (pers_cfg, pers_us) = best(timed, False), best(timed, True)
    return {"case": name, "tile_us": tile_us, "tile_cfg": str(tile_cfg), "persistent_us": pers_us,
            "persistent_cfg": str(pers_cfg), "eager_us": kb.bench(eager), "alone_us": kb.bench(alone),
            "floor_us": max(flops / peak, nbytes / bw) * 1e6, "max_relerr": max(errs) if errs else float("nan"),
            "all": [(str(c), us) for c, us in timed], "by_store": by_store}


def store_table(rows) -> None:
    """Per case: the best config's time with per-thread stores against bulk TMA stores, and the same config's."""
    print(f"\n{'case':32} {'pointer':>8} {'tma':>8} {'gain':>6}  {'same cfg':>8}  best pointer config")
    for r in rows:
        pairs = {c: v for c, v in r["by_store"].items() if len(v) == 2}
        if not pairs:
            continue
        ptr_cfg = min(pairs, key=lambda c: pairs[c][False])
        ptr, tma = pairs[ptr_cfg][False], min(v[True] for v in pairs.values())
        print(f"{r['case'][:32]:32} {ptr:8.1f} {tma:8.1f} {ptr / tma:6.3f}  {ptr / pairs[ptr_cfg][True]:8.3f}  "
              f"{ptr_cfg}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="", help="substring filter on case names")
    p.add_argument("--sigs", default="", help="semicolon list of GEMM epilogues to time instead of each case's own")
    p.add_argument("--stores", action="store_true", help="time each config with per-thread and bulk TMA stores")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    stores = (False, True) if args.stores else (True,)
    peak, bw = kb.measure_ceilings()
    print(f"ceilings: mm {peak / 1e12:.0f} TFLOP/s, copy {bw / 1e9:.0f} GB/s", flush=True)
    gemms = [g if not sig else (f"{g[0]} [{sig}]", *g[1:4], sig)
             for g in GEMMS if args.cases in g[0] for sig in (args.sigs.split(";") if args.sigs else [""])]
    rows = [run_case(gemm_case(g), GemmConfig, peak, bw, stores) for g in gemms]
    rows += [run_case(conv_case(c), ConvConfig, peak, bw, stores) for c in CONVS if args.cases in c.name]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "persistent.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "peak_flops": peak, "copy_bw": bw, "rows": rows}, f,
                  indent=1)
    print(f"\n{'case':32} {'tile':>8} {'persist':>8} {'t/p':>5} {'alone':>8} {'eager':>8} {'floor':>8} {'err':>8}")
    for r in rows:
        print(f"{r['case'][:32]:32} {r['tile_us']:8.1f} {r['persistent_us']:8.1f} "
              f"{r['tile_us'] / r['persistent_us']:5.2f} {r['alone_us']:8.1f} {r['eager_us']:8.1f} "
              f"{r['floor_us']:8.1f} {r['max_relerr']:8.1e}")
        print(f"    tile: {r['tile_cfg']}\n    persistent: {r['persistent_cfg']}")
    if args.stores:
        store_table(rows)


if __name__ == "__main__":
    main()
