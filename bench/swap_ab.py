"""Does a bs1 1x1 conv run faster with its GEMM's operands swapped? (GPU machine; a probe for a later session.)

  python bench/swap_ab.py --out $OUT          # H100: every config of both forms on ResNet-50's bs1 1x1 convs
  TRITON_INTERPRET=1 python bench/swap_ab.py --check   # CPU: both forms against float64 on small shapes

At batch 1 a 1x1 conv is a GEMM of few rows (ResNet-50's layer 4: 49 pixels) and many columns, and its tiles of 32
or 64 rows waste most of each MMA; the tuner's best (32 x 64 tiles split 8) took 5.55 us for layer 4's 2048 -> 512
conv, weights of 2 MB. Swapped, the GEMM computes out^T = W x^T: the weights' output channels are the tile's rows
(64 or 128, full MMAs) and the 49 pixels its columns (16, 32 or 64). One Triton kernel, with the deterministic
split-K of kernels/split_k.py and a bias + relu epilogue, runs both forms through strides; each config is timed as
the tuner times (tuning.choose._bench: replays of a CUDA graph, weights hot in L2). Prints the best of each form a
shape (tile rows x columns, split), beside the tuner's cached best (BENCHMARKS.md, forty-fourth session); all rows
go to $OUT/swap_ab.json.
"""
import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse.kernels.split_k import split_k_reduce  # noqa: E402

# (pixels M, in channels K, out channels N): ResNet-50's 1x1 convs at batch 1, and the tuner's best (us, H100,
# bias + relu, or with the residual add where marked; the forty-third session's cache)
SHAPES = {(49, 2048, 512): 5.55, (49, 512, 2048): 3.88, (196, 1024, 256): 4.00, (196, 256, 1024): 3.07,
          (196, 1024, 512): 4.23}


@triton.jit
def _gemm(a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, tickets_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
          BIAS_ON_ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    chunk = K // SPLIT
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(pid_k * chunk, (pid_k + 1) * chunk, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak, mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn, mask=rn[None, :] < N, other=0.0)
        acc += tl.dot(a, b)
    last = True
    if SPLIT > 1:
        acc, last = split_k_reduce(acc, ws_ptr, tickets_ptr, pid_m * tl.num_programs(1) + pid_n, pid_k, BM, BN,
                                   SPLIT)
    if BIAS_ON_ROWS:
        y = acc + tl.load(bias_ptr + rm, mask=rm < M, other=0.0).to(tl.float32)[:, None]
    else:
        y = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y = tl.maximum(y, 0.0)
    mask = (rm[:, None] < M) & (rn[None, :] < N) & last
    tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, y.to(c_ptr.dtype.element_ty), mask=mask)


def launcher(x, w, bias, out, swap: bool, bm: int, bn: int, bk: int, split: int):
    """A callable running relu(x @ w^T + bias) into out ([M, N], N contiguous), plain or swapped."""
    m, k = x.shape
    n = w.shape[0]
    if swap:  # out^T [N, M] = w [N, K] @ x^T [K, M]
        rows, cols, a, b = n, m, w, x
        strides = (k, 1, 1, k, 1, n)
    else:  # out [M, N] = x [M, K] @ w^T [K, N]
        rows, cols, a, b = m, n, x, w
        strides = (k, 1, 1, k, n, 1)
    grid = (triton.cdiv(rows, bm), triton.cdiv(cols, bn), split)
    ws = torch.empty(grid[0] * grid[1] * split * bm * bn, device=x.device, dtype=torch.float32)
    tickets = torch.zeros(grid[0] * grid[1], device=x.device, dtype=torch.int32)
    return lambda: _gemm[grid](a, b, out, bias, ws, tickets, rows, cols, k, *strides, BIAS_ON_ROWS=swap, BM=bm,
                               BN=bn, BK=bk, SPLIT=split, num_warps=4, num_stages=3)


def configs(m, k, n):
    for swap in (False, True):
        tiles = ((64, 16), (64, 32), (64, 64), (128, 32)) if swap else ((32, 64), (64, 64))
        for (bm, bn), split in itertools.product(tiles, (1, 2, 4, 8, 16)):
            if k % (split * 64) == 0:
                yield swap, bm, bn, 64, split


def check():
    """Both forms against float64 on shapes not multiples of the tiles (CPU, under the interpreter)."""
    torch.manual_seed(0)
    for m, k, n in ((49, 256, 80), (20, 128, 48)):
        x, w, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        want = torch.relu(x.double() @ w.double().T + bias.double())
        for swap, bm, bn, bk, split in configs(m, k, n):
            if split > 2 or bm > 64:
                continue
            out = torch.full((m, n), float("nan"))
            launcher(x, w, bias, out, swap, bm, bn, bk, split)()
            err = ((out.double() - want).norm() / want.norm()).item()
            assert err < 1e-5, (m, k, n, swap, bm, bn, split, err)
    print("both forms match float64")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.check:
        return check()
    from resfuse.tuning.choose import _bench

    rows = []
    for (m, k, n), cached in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.float16)
        want = torch.relu(x.double() @ w.double().T + bias.double())
        for swap, bm, bn, bk, split in configs(m, k, n):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
            run = launcher(x, w, bias, out, swap, bm, bn, bk, split)
            try:
                run()
                err = ((out.double() - want).norm() / want.norm()).item()
                us = _bench(run) * 1e6
            except Exception as e:  # noqa: BLE001  a config that does not fit is a row too
                err, us = float("nan"), float("nan")
                print(f"{(m, k, n)} swap={swap} {bm}x{bn} split {split}: {type(e).__name__}")
            rows.append({"shape": [m, k, n], "swap": swap, "bm": bm, "bn": bn, "split": split, "us": us,
                         "rel_err": err, "tuner_best_us": cached})
        with open(os.path.join(args.out, "swap_ab.json"), "w") as f:  # after each shape: a cut-off run keeps some
            json.dump(rows, f, indent=1)
        best = {}
        for swap in (False, True):
            ok = [r for r in rows if tuple(r["shape"]) == (m, k, n) and r["swap"] == swap and r["rel_err"] < 1e-2]
            best[swap] = min(ok, key=lambda r: r["us"]) if ok else None
        cells = [f"{b['us']:>8.2f} us {str((b['bm'], b['bn'], b['split'])):<16}" if b else f"{'-':<28}"
                 for b in (best[False], best[True])]
        print(f"M, K, N {str((m, k, n)):<18} tuner's best {cached:.2f} us; plain {cells[0]} swapped {cells[1]}",
              flush=True)


if __name__ == "__main__":
    main()
