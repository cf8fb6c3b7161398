"""GPU probe: is a bottleneck's tail 1x1 conv worth fusing with the next block's head 1x1 conv (a back-to-back
GEMM: y = relu(A @ W1 * s1 + b1 + residual), z = relu(y @ W2 * s2 + b2), y stored for the next residual)?

Entry point: `python bench/chain_proto.py [--batches 256,32] [--pairs S,S] [--quick] [--out DIR]`, on a GPU
machine. A prototype Triton kernel (persistent, TMA descriptors, y kept in registers between the two products,
the batch norms as folded scale and shift) is timed per config on ResNet-50's tail/head pairs and checked against
fp32. The peer is what resfuse ran before the chain: the two fused convs (batch norm + residual + relu, then
batch norm + relu), each tuned on its own. The product column is resfuse::conv2d_chain as tuned (kernels/chain.py,
generated epilogues; or the two convs, where those win), with the choice named. Also shown: the two bare cuDNN
1x1 convs, and the floors of both forms. The prototype's epilogues are fixed, not generated from a signature.
Prints a table; rows go to DIR/chain.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
import kernels as kb  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import resfuse.ops  # noqa: E402,F401  registers torch.ops.resfuse
from resfuse.ops import chain as chain_op  # noqa: E402
from resfuse.tuning import choose  # noqa: E402

# (name, H=W, K1 = the tail's input channels, N1 = its output channels, N2 = the next head's output channels)
PAIRS = [("l1 64>256>64", 56, 64, 256, 64), ("l1>l2 64>256>128", 56, 64, 256, 128),
         ("l2 128>512>128", 28, 128, 512, 128), ("l3 256>1024>256", 14, 256, 1024, 256)]
# (layer 4's 512>2048>512 pair is left out: its A and W2 boxes would pass TMA's 256-element limit)


@triton.jit
def chain_kernel(a_d, w1_d, w2_d, r_d, y_d, z_d, s1, b1, s2, b2, M, PROGS,
                 K1: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
                 BM: tl.constexpr, BN1: tl.constexpr):
    for t in tl.range(tl.program_id(0), tl.cdiv(M, BM), PROGS):
        m0 = t * BM
        acc2 = tl.zeros([BM, N2], tl.float32)
        a = a_d.load([m0, 0])  # the whole [BM, K1] row block, read once for every chunk of N1
        for j in tl.static_range(0, N1, BN1):
            acc1 = tl.dot(a, w1_d.load([0, j]), tl.zeros([BM, BN1], tl.float32))
            cols = j + tl.arange(0, BN1)
            r = r_d.load([m0, j]).to(tl.float32)
            y = tl.maximum(acc1 * tl.load(s1 + cols)[None, :] + tl.load(b1 + cols)[None, :] + r, 0.0).to(tl.float16)
            y_d.store([m0, j], y)
            acc2 = tl.dot(y, w2_d.load([j, 0]), acc2)
        cols2 = tl.arange(0, N2)
        z = tl.maximum(acc2 * tl.load(s2 + cols2)[None, :] + tl.load(b2 + cols2)[None, :], 0.0)
        z_d.store([m0, 0], z.to(tl.float16))


def configs(k1, n1, n2):
    for bm in (64,) if QUICK else (64, 128):
        for bn1 in (128,) if QUICK else (64, 128, 256):
            for warps in (4, 8):
                if bn1 > n1 or bm * (n2 + bn1 + k1 // 2) > 192 * 32 * warps:
                    continue
                for stages in (1, 2):
                    for per_sm in (1, 2):
                        yield dict(BM=bm, BN1=bn1, num_warps=warps, num_stages=stages, per_sm=per_sm)


QUICK = False  # --quick: the tiles that won every pair of the full sweep (BM 64, BN1 128)


def run_pair(name, hw, k1, n1, n2, batch, peak, bw) -> dict:
    m = batch * hw * hw
    dev, h = "cuda", torch.float16
    a = torch.randn(m, k1, device=dev, dtype=h)
    w1 = torch.randn(k1, n1, device=dev, dtype=h) / k1**0.5
    w2 = torch.randn(n1, n2, device=dev, dtype=h) / n1**0.5
    res = torch.randn(m, n1, device=dev, dtype=h)
    s1, b1, s2, b2 = (torch.rand(n, device=dev) + 0.5 for n in (n1, n1, n2, n2))
    y = torch.empty(m, n1, device=dev, dtype=h)
    z = torch.empty(m, n2, device=dev, dtype=h)
    y_ref = torch.relu(a.float() @ w1.float() * s1 + b1 + res.float())
    z_ref = torch.relu(y_ref.half().float() @ w2.float() * s2 + b2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for cfg in configs(k1, n1, n2):
        bm, bn1 = cfg["BM"], cfg["BN1"]
        descs = (TensorDescriptor.from_tensor(a, [bm, k1]), TensorDescriptor.from_tensor(w1, [k1, bn1]),
                 TensorDescriptor.from_tensor(w2, [bn1, n2]), TensorDescriptor.from_tensor(res, [bm, bn1]),
                 TensorDescriptor.from_tensor(y, [bm, bn1]), TensorDescriptor.from_tensor(z, [bm, n2]))
        progs = min(triton.cdiv(m, bm), sms * cfg["per_sm"])

        def go(descs=descs, progs=progs, cfg=cfg):
            chain_kernel[(progs,)](*descs, s1, b1, s2, b2, m, progs, K1=k1, N1=n1, N2=n2, BM=cfg["BM"],
                                   BN1=cfg["BN1"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        try:
            y.fill_(float("nan"))
            z.fill_(float("nan"))
            go()
            err = max(kb.rel_err(y, y_ref), kb.rel_err(z, z_ref))
            us = kb.bench(go)
        except Exception as e:  # a config that does not compile (registers, shared memory) is reported
            print(f"  {name} bs{batch} {cfg}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        print(f"  {name} bs{batch} {cfg}: {us:.1f} us, err {err:.1e}", flush=True)
        rows.append((cfg, us, err))
    x1 = a.view(batch, hw, hw, k1).permute(0, 3, 1, 2)  # channels_last NCHW views
    x2 = y.view(batch, hw, hw, n1).permute(0, 3, 1, 2)
    c1 = w1.t().contiguous().view(n1, k1, 1, 1)
    c2 = w2.t().contiguous().view(n2, n1, 1, 1)
    cudnn = kb.bench(lambda: F.conv2d(x1, c1)) + kb.bench(lambda: F.conv2d(x2, c2))
    # what resfuse runs today: the two fused convs, each tuned on its own (batch norm + residual + relu, then
    # batch norm + relu), the batch norms as inference's (mean, var, weight, bias) vectors
    bn1, bn2 = ([torch.randn(n, device=dev, dtype=h), torch.rand(n, device=dev, dtype=h) + 0.5,
                 torch.randn(n, device=dev, dtype=h), torch.randn(n, device=dev, dtype=h)] for n in (n1, n2))
    r4 = res.view(batch, hw, hw, n1).permute(0, 3, 1, 2)
    one = ([1, 1], [0, 0], [1, 1])

    def fused_pair():
        y4 = torch.ops.resfuse.conv2d(x1, c1, [*bn1, r4], "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))", *one,
                                      "triton")
        return torch.ops.resfuse.conv2d(y4, c2, bn2, "relu(bn[#1e-05](acc,c0,c1,c2,c3))", *one, "triton")
    fused_pair()  # tunes both
    z_now = fused_pair()
    now = kb.bench(fused_pair)
    # the product: resfuse::conv2d_chain as the tuner chose it (our chain kernel, or the two convs above)
    chain_args = (x1, c1, [*bn1, r4], "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))", c2, bn2,
                  "relu(bn[#1e-05](acc,c0,c1,c2,c3))")
    torch.ops.resfuse.conv2d_chain(*chain_args, "triton")  # first sight: the two convs, then the chain is tuned
    product_choice = choose.settled(chain_op.call_of(*chain_args))
    _, z_product = torch.ops.resfuse.conv2d_chain(*chain_args, "triton")
    product = kb.bench(lambda: torch.ops.resfuse.conv2d_chain(*chain_args, "triton"))
    flops = 2 * m * (k1 * n1 + n1 * n2)
    sep_bytes = 2 * m * (k1 + 3 * n1 + n1 + n2)  # tail reads a, res, writes y; head reads y, writes z
    chain_bytes = 2 * m * (k1 + 2 * n1 + n2)
    best = min(rows, key=lambda r: r[1]) if rows else (None, float("nan"), float("nan"))
    return {"pair": name, "batch": batch, "chain_us": best[1], "chain_cfg": best[0], "err": best[2],
            "cudnn_pair_us": cudnn, "resfuse_pair_us": now, "product_us": product,
            "product_choice": f"{product_choice.provider} {product_choice.config}",
            "product_err_vs_pair": kb.rel_err(z_product, z_now.float()),
            "floor_separate_us": max(flops / peak, sep_bytes / bw) * 1e6,
            "floor_chain_us": max(flops / peak, chain_bytes / bw) * 1e6, "all": [(c, u) for c, u, _ in rows]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="256,32")
    p.add_argument("--pairs", default="", help="comma list of substrings of pair names")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--quick", action="store_true", help="only the tiles that won the full sweep")
    args = p.parse_args(argv)
    global QUICK
    QUICK = args.quick
    from resfuse.config import Config
    cfg = Config.from_env()  # the tuner's settings, as resfuse.compile applies them
    choose.configure(cfg.tuning, cfg.cache_dir, cfg.tuning_budget_s, cfg.retune)
    peak, bw = kb.measure_ceilings()
    torch.backends.cudnn.benchmark = True
    wanted = [pp for pp in PAIRS if not args.pairs or any(s in pp[0] for s in args.pairs.split(","))]
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for b in args.batches.split(","):
        for pp in wanted:
            rows.append(run_pair(*pp, int(b), peak, bw))
            with open(os.path.join(args.out, "chain.json"), "w") as f:  # after each pair: a timeout keeps the rest
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1, default=str)
    print(f"\n{'pair':20} {'bs':>4} {'chain':>8} {'resfuse':>8} {'ratio':>6} {'product':>8} {'ratio':>6} "
          f"{'cuDNN x2':>9} {'floor sep':>9} {'floor chain':>11} {'err':>8}")
    for r in rows:
        print(f"{r['pair']:20} {r['batch']:4} {r['chain_us']:8.1f} {r['resfuse_pair_us']:8.1f} "
              f"{r['resfuse_pair_us'] / r['chain_us']:6.2f} {r['product_us']:8.1f} "
              f"{r['resfuse_pair_us'] / r['product_us']:6.2f} {r['cudnn_pair_us']:9.1f} {r['floor_separate_us']:9.1f} "
              f"{r['floor_chain_us']:11.1f} {r['err']:8.1e}   {r['chain_cfg']}  product: {r['product_choice']}")


if __name__ == "__main__":
    main()
