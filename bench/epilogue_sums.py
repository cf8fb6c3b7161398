"""What do batch-norm backward's sums cost in a GEMM epilogue: the load of x, or the column reduction? A probe.

Entry point: `python bench/epilogue_sums.py [--out DIR]`, on a GPU machine.
With `bn_backward_sums` the data gradient's epilogue also reduces sum(g) and sum(g * (x - mean)) per channel
over its tile (codegen.py), and that measured 3.4 ms slower a ResNet-50 step than the 3.3 ms pass it replaces
(BENCHMARKS, fourteenth session), even with x read through a TMA descriptor (fifteenth). This times one TMA
GEMM tile (as bench/epilogue_prefetch.py, operands through descriptors) with the dgrad's epilogue
g = (acc + r1) * (r2 > 0), stored, then:
  none:   nothing more (the kernel the separate pass follows);
  load:   x loaded and used without a reduction (y + 0 * x), to price the load alone;
  sums:   both sums by tl.reduce over the tile's rows (what codegen does);
  dot:    both sums on the tensor cores, ones[16, BM] @ tile: g as it is (fp16, exact), g * (x - mean) split
          into three bf16 parts that add up to its fp32 value, so the products are exact and fp32 accumulates;
  reload: g stored, then (after a barrier) read back from L2 in chunks of RC rows, with x by pointer, both sums
          added up per chunk in a blocked layout and reduced over the chunk's rows once at the end;
and, for the forward statistics a conv's epilogue could compute (batch norm's sum(y) and sum(y * y) over the
conv's raw output y = acc, which no operand joins):
  fwd:        y stored and nothing more;
  fwd-sums:   both sums by tl.reduce over the tile's rows;
  fwd-reload: both sums over y read back from L2 in chunks, as reload;
each in a one-tile-a-program grid and as a persistent kernel. The sums are checked against float64.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.epilogue_prefetch import SHAPES, TILES, problem, setup, timed  # noqa: E402
from resfuse.kernels.activations import sum_rows  # noqa: E402
from resfuse.kernels.tiles import cdiv, swizzle_tile  # noqa: E402


@triton.jit
def _ones_sum(t, ones):
    """Column sums of t [BM, BN] (16-bit) as ones [16, BM] @ t on the tensor cores, then one of the 16 equal rows."""
    s = tl.dot(ones, t, out_dtype=tl.float32)
    return sum_rows(s) * (1.0 / 16.0)


@triton.jit
def _reload_sums(out, x, mean, tile_m, cols, M, N, BM: tl.constexpr, BN: tl.constexpr, RC: tl.constexpr,
                 FWD: tl.constexpr):
    """Column sums of the stored tile g read back in [RC, BN] chunks: (sum g, sum g * (x - mean)), or with FWD
    (sum g, sum g * g)."""
    tl.debug_barrier()  # the tile's stores, made by every thread of the program, are visible to all of them
    ok_c = cols < N
    mu = tl.load(mean + cols, mask=ok_c, other=0.0)
    s1 = tl.full((RC, BN), 0.0, dtype=tl.float32)
    s2 = tl.full((RC, BN), 0.0, dtype=tl.float32)
    for r0 in tl.static_range(0, BM, RC):
        rows = tile_m * BM + r0 + tl.arange(0, RC)
        ok = (rows < M)[:, None] & ok_c[None, :]
        g = tl.load(out + rows[:, None] * N + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        s1 += g
        if FWD:
            s2 += g * g
        else:
            xv = tl.load(x + rows[:, None] * N + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            s2 += tl.where(ok, g * (xv - mu[None, :]), 0.0)
    return sum_rows(s1), sum_rows(s2)


@triton.jit
def _tile(tile_id, a_desc, b_desc, out, r1_desc, r2_desc, x_desc, x, mean, part, M, N, K, R,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr, RC: tl.constexpr):
    tile_m, tile_n = swizzle_tile(tile_id, cdiv(M, BM), cdiv(N, BN), 8)
    rows = tile_m * BM + tl.arange(0, BM)
    cols = tile_n * BN + tl.arange(0, BN)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for kb in tl.range(0, cdiv(K, BK)):
        acc = tl.dot(a_desc.load([tile_m * BM, kb * BK]), b_desc.load([kb * BK, tile_n * BN]), acc)
    if MODE >= 5:  # the forward statistics: the conv's raw output
        y = acc
    else:
        v1 = r1_desc.load([tile_m * BM, tile_n * BN]).to(tl.float32)
        v2 = r2_desc.load([tile_m * BM, tile_n * BN])
        y = tl.where(v2 > 0, acc + v1, 0.0)
    if MODE == 1:
        y = y + 0.0 * x_desc.load([tile_m * BM, tile_n * BN]).to(tl.float32)
    tl.store(out + rows[:, None] * N + cols[None, :], y.to(tl.float16), mask=ok)
    if MODE == 4 or MODE == 7:
        s1, s2 = _reload_sums(out, x, mean, tile_m, cols, M, N, BM, BN, RC, MODE == 7)
        ok_c = cols < N
        tl.store(part + cols * R + tile_m, s1, mask=ok_c)
        tl.store(part + (N + cols) * R + tile_m, s2, mask=ok_c)
    if MODE == 6:
        ok_c = cols < N
        g = tl.where(ok, y.to(tl.float16).to(tl.float32), 0.0)
        tl.store(part + cols * R + tile_m, sum_rows(g), mask=ok_c)
        tl.store(part + (N + cols) * R + tile_m, sum_rows(g * g), mask=ok_c)
    if MODE == 2 or MODE == 3:
        ok_c = cols < N
        g = tl.where(ok, y.to(tl.float16).to(tl.float32), 0.0)
        mu = tl.load(mean + cols, mask=ok_c, other=0.0)
        t = g * (x_desc.load([tile_m * BM, tile_n * BN]).to(tl.float32) - mu[None, :])
        if MODE == 2:
            s1 = sum_rows(g)
            s2 = sum_rows(t)
        else:
            ones = tl.full((16, BM), 1.0, tl.bfloat16)
            s1 = _ones_sum(g.to(tl.float16), tl.full((16, BM), 1.0, tl.float16))
            hi = t.to(tl.bfloat16)
            rest = t - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            s2 = _ones_sum(hi, ones) + _ones_sum(mid, ones) + _ones_sum(lo, ones)
        tl.store(part + cols * R + tile_m, s1, mask=ok_c)
        tl.store(part + (N + cols) * R + tile_m, s2, mask=ok_c)


@triton.jit
def gemm_sums(a_desc, b_desc, out, r1_desc, r2_desc, x_desc, x, mean, part, M, N, K, R, TILES,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr, RC: tl.constexpr,
              PERSISTENT: tl.constexpr):
    if PERSISTENT:
        for tile_id in tl.range(tl.program_id(0), TILES, tl.num_programs(0), flatten=True):
            _tile(tile_id, a_desc, b_desc, out, r1_desc, r2_desc, x_desc, x, mean, part, M, N, K, R, BM, BN, BK, MODE,
                  RC)
    else:
        _tile(tl.program_id(0), a_desc, b_desc, out, r1_desc, r2_desc, x_desc, x, mean, part, M, N, K, R, BM, BN, BK,
              MODE, RC)


MODES = {"none": 0, "load": 1, "sums": 2, "dot": 3, "reload": 4, "fwd": 5, "fwd-sums": 6, "fwd-reload": 7}


def main() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--modes", default=",".join(MODES), help="which of " + ", ".join(MODES))
    ap.add_argument("--rc", type=int, default=16, help="rows a chunk of the reload modes")
    args = ap.parse_args()
    sms, bw = setup()
    records, table = [], []
    for m, n, k in SHAPES:
        a, b, r1, r2, x = problem(m, n, k, 3)
        x = x * 2 + 3
        mean = x.float().mean(0)
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        best = {}
        for mode, code in ((m_, MODES[m_]) for m_ in args.modes.split(",")):
            for persistent in (False, True):
                for bm, bn, bk, stages, warps in TILES:
                    rb = triton.cdiv(m, bm)
                    part = torch.empty(2, n, rb, device="cuda", dtype=torch.float32)
                    descs = [TensorDescriptor.from_tensor(t, box) for t, box in
                             ((a, [bm, bk]), (b, [bk, bn]), (r1, [bm, bn]), (r2, [bm, bn]), (x, [bm, bn]))]
                    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                    grid = (min(tiles, sms),) if persistent else (tiles,)

                    def run():
                        gemm_sums[grid](*descs[:2], out, *descs[2:], x, mean, part, m, n, k, rb, tiles, BM=bm, BN=bn,
                                        BK=bk, MODE=code, RC=args.rc, PERSISTENT=persistent, num_stages=stages,
                                        num_warps=warps)
                    rec = {"shape": [m, n, k], "mode": mode, "persistent": persistent,
                           "tile": [bm, bn, bk, stages, warps]}
                    try:
                        part.fill_(float("nan"))
                        run()
                        if code >= 2 and code != 5:
                            gd = out.double()
                            other = gd if code >= 6 else x.double() - mean.double()
                            want = torch.stack([gd.sum(0), (gd * other).sum(0)])
                            bound = 1e-5 * torch.stack([gd.abs().sum(0), (gd * other).abs().sum(0)]) + 1e-6
                            err = ((part.double().sum(-1) - want).abs() / bound).max().item()
                            assert err <= 1, f"sums off by {err:.2f} x the fp32 bound"
                        rec["ms"] = timed(run)
                    except Exception as e:  # out of registers or shared memory: record and go on
                        rec["error"] = str(e)[:300]
                    records.append(rec)
                    if "ms" in rec and ((mode, persistent) not in best or rec["ms"] < best[mode, persistent][0]):
                        best[mode, persistent] = (rec["ms"], (bm, bn))
                    if "error" in rec and "sums off" in rec["error"]:
                        print(rec, flush=True)
        for (mode, persistent), (ms, tile) in sorted(best.items(), key=lambda kv: kv[1][0]):
            passes = 1 if mode.startswith("fwd") else 2  # the separate pass reads y, or g and x
            table.append(f"{m:>7}x{n:<5}K{k:<4} {mode:10s} {'pers' if persistent else 'grid':5s} {tile[0]}x{tile[1]:<4} "
                         f"{ms:8.4f} ms   the pass it would replace {passes * m * n * 2 / bw * 1e3:.4f} ms")
        print("\n".join(table[-len(best):]), flush=True)
    with open(os.path.join(args.out, "epilogue_sums.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "records": records}, f, indent=1)
    print("\n".join(table))


if __name__ == "__main__":
    main()
