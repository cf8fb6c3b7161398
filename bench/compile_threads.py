"""Does Triton's compiler overlap across threads? (It decides whether tuning compiles candidates in parallel.)

Entry point: `python bench/compile_threads.py [--kernels 6] [--threads 2]`, on any machine with the triton
wheel (no GPU: it compiles for sm_90 as bench/ptx_check.py does). It compiles N distinct generated GEMM
kernels serially, then N others on a thread pool, each batch into a fresh Triton cache, and prints both wall
times.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ptx_check  # noqa: E402

from resfuse.kernels import matmul  # noqa: E402

EPILOGUES = ["relu(add(acc,c0))", "gelu(add(acc,c0))", "silu(add(acc,c0))", "add(acc,c0)",
             "sigmoid(add(acc,c0))", "tanh(add(acc,c0))"]


def build(i: int) -> None:
    types = {n: "i32" for n in matmul.FAMILY.args}
    types.update(a="*fp16", b="*fp16")
    constexprs = {"BM": (64, 128)[i % 2], "BN": 128, "BK": 64, "GROUP_M": 8, "SPLIT_K": 1, "PRECISION": "tf32",
                  "EVEN_K": bool((i // len(EPILOGUES)) % 2)}
    ptx_check.compile_ptx(matmul.FAMILY, EPILOGUES[i % len(EPILOGUES)], types, constexprs,
                          num_stages=3 + (i // (2 * len(EPILOGUES))) % 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    n = args.kernels
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    t0 = time.perf_counter()
    for i in range(n):
        build(i)
    serial = time.perf_counter() - t0
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        list(pool.map(build, range(n, 2 * n)))
    threaded = time.perf_counter() - t0
    print(f"{n} kernels: serial {serial:.2f} s, {args.threads} threads {threaded:.2f} s "
          f"({serial / threaded:.2f}x), {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
