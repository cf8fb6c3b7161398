"""Do epilogue operand loads cost less when they overlap the mainloop? A probe, not product code.

Entry point: `python bench/epilogue_prefetch.py [--out DIR]`, on a GPU machine.
Our generated kernels load an epilogue's full-size operands (a residual, relu's saved output) after the GEMM's
reduction loop, so those loads are exposed (BENCHMARKS, fourteenth session: one more full operand costs about
twice its bytes at peak bandwidth). This times one TMA GEMM tile, as matmul.gemm_tma_tile computes it, with
the epilogue of ResNet-50's 1x1 convs (relu(acc + r1): a residual block's last conv) and of their data gradients
((acc + r1) * (r2 > 0): the skip gradient's add and relu's backward), the operands loaded:
  after: by pointer after the loop (what codegen does now);
  early: by pointer before the loop, so the loads are in flight during it;
  tma:   through a TMA descriptor after the loop;
  tma-early: through a TMA descriptor before the loop;
  tma+store: through a TMA descriptor after the loop, and the output stored through one too;
each in a one-tile-a-program grid and as a persistent kernel (codegen's flattened loop), at three tiles. Peers
in the same run: cuBLAS's mm alone and mm + ATen's add (+ relu / mask), and a copy's bandwidth. Prints the best
time per (shape, epilogue, load, persistent) and the bytes-at-copy-bandwidth floor; all times go to
DIR/epilogue_prefetch.json.
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

from resfuse.kernels.tiles import cdiv, swizzle_tile  # noqa: E402


@triton.jit
def _operands(r1, r2, r1_desc, r2_desc, rows, cols, ok, tile_m, tile_n, N,
              BM: tl.constexpr, BN: tl.constexpr, NOPS: tl.constexpr, TMA: tl.constexpr):
    v1 = tl.full((BM, BN), 0.0, tl.float16)
    v2 = tl.full((BM, BN), 0.0, tl.float16)
    if NOPS >= 1:
        if TMA:
            v1 = r1_desc.load([tile_m * BM, tile_n * BN])
        else:
            v1 = tl.load(r1 + rows[:, None] * N + cols[None, :], mask=ok, other=0.0)
    if NOPS >= 2:
        if TMA:
            v2 = r2_desc.load([tile_m * BM, tile_n * BN])
        else:
            v2 = tl.load(r2 + rows[:, None] * N + cols[None, :], mask=ok, other=0.0)
    return v1, v2


@triton.jit
def _tile(tile_id, a_desc, b_desc, out, r1, r2, r1_desc, r2_desc, o_desc, M, N, K,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NOPS: tl.constexpr, EARLY: tl.constexpr,
          TMA: tl.constexpr, STORE_TMA: tl.constexpr):
    tile_m, tile_n = swizzle_tile(tile_id, cdiv(M, BM), cdiv(N, BN), 8)
    rows = tile_m * BM + tl.arange(0, BM)
    cols = tile_n * BN + tl.arange(0, BN)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    if EARLY:
        v1, v2 = _operands(r1, r2, r1_desc, r2_desc, rows, cols, ok, tile_m, tile_n, N, BM, BN, NOPS, TMA)
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for kb in tl.range(0, cdiv(K, BK)):
        acc = tl.dot(a_desc.load([tile_m * BM, kb * BK]), b_desc.load([kb * BK, tile_n * BN]), acc)
    if not EARLY:
        v1, v2 = _operands(r1, r2, r1_desc, r2_desc, rows, cols, ok, tile_m, tile_n, N, BM, BN, NOPS, TMA)
    if NOPS == 1:
        acc = tl.maximum(acc + v1.to(tl.float32), 0.0)
    if NOPS == 2:
        acc = tl.where(v2 > 0, acc + v1.to(tl.float32), 0.0)
    if STORE_TMA:
        o_desc.store([tile_m * BM, tile_n * BN], acc.to(tl.float16))
    else:
        tl.store(out + rows[:, None] * N + cols[None, :], acc.to(tl.float16), mask=ok)


@triton.jit
def gemm_epilogue(a_desc, b_desc, out, r1, r2, r1_desc, r2_desc, o_desc, M, N, K, TILES,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NOPS: tl.constexpr, EARLY: tl.constexpr,
                  TMA: tl.constexpr, STORE_TMA: tl.constexpr, PERSISTENT: tl.constexpr):
    if PERSISTENT:
        for tile_id in tl.range(tl.program_id(0), TILES, tl.num_programs(0), flatten=True):
            _tile(tile_id, a_desc, b_desc, out, r1, r2, r1_desc, r2_desc, o_desc, M, N, K, BM, BN, BK, NOPS, EARLY, TMA,
                  STORE_TMA)
    else:
        _tile(tl.program_id(0), a_desc, b_desc, out, r1, r2, r1_desc, r2_desc, o_desc, M, N, K, BM, BN, BK, NOPS,
              EARLY, TMA, STORE_TMA)


def timed(fn, reps: int = 25) -> float:
    """Median ms of reps calls, each between two events, after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def setup() -> tuple[int, float]:
    """(SMs, copy bandwidth in bytes a second), printed; Triton's allocator for descriptors set."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    return torch.cuda.get_device_properties(0).multi_processor_count, bw


def problem(m: int, n: int, k: int, full: int) -> tuple:
    """A [M, K], B [K, N] (scaled so the product stays O(1)) and `full` random [M, N] operands, all fp16."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16, generator=g) / k ** 0.5
    return (a, b, *(torch.randn(m, n, device="cuda", dtype=torch.float16, generator=g) for _ in range(full)))


def copy_bandwidth() -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / (timed(lambda: dst.copy_(src)) * 1e-3)


SHAPES = ((256 * 56 * 56, 256, 64), (256 * 28 * 28, 512, 128), (256 * 14 * 14, 1024, 256), (256 * 7 * 7, 2048, 512))
TILES = ((128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8))  # BM, BN, BK, stages, warps
LOADS = {"after": (False, False, False), "early": (True, False, False), "tma": (False, True, False),
         "tma-early": (True, True, False), "tma+store": (False, True, True)}


def main() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--loads", default=",".join(LOADS), help="which of " + ", ".join(LOADS))
    args = ap.parse_args()
    sms, bw = setup()
    records, table = [], []
    for m, n, k in SHAPES:
        a, b, r1, r2 = problem(m, n, k, 2)
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        ref = {1: torch.relu(a.float() @ b.float() + r1.float()),
               2: torch.where(r2 > 0, a.float() @ b.float() + r1.float(), 0.0)}
        peers = {0: timed(lambda: torch.mm(a, b, out=out)),
                 1: timed(lambda: torch.relu_(torch.add(torch.mm(a, b), r1, out=out))),
                 2: timed(lambda: torch.where(r2 > 0, torch.mm(a, b) + r1, 0.0))}
        for nops in (0, 1, 2):
            floor = (m * k + k * n + m * n * (1 + nops)) * 2 / bw * 1e3
            best = {}
            for load, (early, tma, store_tma) in LOADS.items():
                if load not in args.loads.split(",") or (nops == 0 and load not in ("after", "tma+store")):
                    continue
                for persistent in (False, True):
                    for bm, bn, bk, stages, warps in TILES:
                        descs = [TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bk, bn]),
                                 TensorDescriptor.from_tensor(r1, [bm, bn]), TensorDescriptor.from_tensor(r2, [bm, bn]),
                                 TensorDescriptor.from_tensor(out, [bm, bn])]
                        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                        grid = (min(tiles, sms),) if persistent else (tiles,)

                        def run():
                            gemm_epilogue[grid](descs[0], descs[1], out, r1, r2, descs[2], descs[3], descs[4], m, n, k, tiles,
                                                BM=bm, BN=bn, BK=bk, NOPS=nops, EARLY=early, TMA=tma, STORE_TMA=store_tma,
                                                PERSISTENT=persistent, num_stages=stages, num_warps=warps)
                        try:
                            out.fill_(float("nan"))
                            run()
                            if nops:
                                err = ((out.float() - ref[nops]).abs().max() / ref[nops].abs().max()).item()
                                assert err < 1e-2, f"wrong result: relative error {err}"
                            ms = timed(run)
                        except Exception as e:  # out of registers or shared memory: record and go on
                            records.append({"shape": [m, n, k], "nops": nops, "load": load, "persistent": persistent,
                                            "tile": [bm, bn, bk, stages, warps], "error": str(e)[:200]})
                            continue
                        records.append({"shape": [m, n, k], "nops": nops, "load": load, "persistent": persistent,
                                        "tile": [bm, bn, bk, stages, warps], "ms": ms})
                        key = (load, persistent)
                        if key not in best or ms < best[key][0]:
                            best[key] = (ms, (bm, bn))
            for (load, persistent), (ms, tile) in sorted(best.items(), key=lambda kv: kv[1][0]):
                table.append(f"{m:>7}x{n:<5}K{k:<4} ops={nops} {load:10s} {'pers' if persistent else 'grid':5s} "
                             f"{tile[0]}x{tile[1]:<4} {ms:8.4f} ms  floor {floor:.4f}  {floor / ms:5.1%} of bw  "
                             f"cuBLAS+ATen {peers[nops]:.4f}")
            print("\n".join(table[-len(best):]), flush=True)
    with open(os.path.join(args.out, "epilogue_prefetch.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "records": records}, f, indent=1)
    print("\n".join(table))


if __name__ == "__main__":
    main()
