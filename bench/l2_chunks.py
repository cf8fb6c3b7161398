"""GPU probe: cuBLAS + our epilogue pass, with the GEMM split into row chunks whose output fits in L2.

The "aten+epilogue" provider runs cuBLAS over the whole output, then the epilogue kernel in place over it. Where
the output is larger than L2 (50 MB on an H100), the pass reads most of it back from HBM: BERT's FFN1 at bs32
(12288 x 3072 fp16, 75 MB) spends 59 us a layer in its GELU pass. Split into row chunks of a few MB, each chunk's
pass finds the chunk's rows still in L2 and overwrites them there, so the rows go out to HBM once. Measured slower
on every case (BENCHMARKS.md, twenty-eighth session): the pass is bound by GELU's arithmetic, not by memory.

Entry point: `python bench/l2_chunks.py [--cases SUBSTR] [--mb 8,16,24] [--out DIR]`, on a GPU machine. Per case
it times (CUDA-graph replays, median): cuBLAS alone, cuBLAS in chunks alone, cuBLAS + the pass (what runs now),
and cuBLAS + the pass per chunk for each chunk size, each result checked against an fp32 reference. The table
goes to stdout last; the rows to DIR/l2_chunks.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import kernels as kb  # noqa: E402  bench/kernels.py: the timer and rel_err

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import epilogue as epi, kernels  # noqa: E402

GELU = "gelu(add(acc,c0))"
# (name, M, N, K, signature)
CASES = [
    ("bert bs32 ffn1", 32 * 384, 3072, 768, GELU),
    ("bert bs32 ffn2 +res", 32 * 384, 768, 3072, "add(add(acc,c0),full1)"),
    ("bert bs256 ffn1", 256 * 384, 3072, 768, GELU),
    ("vit bs32 ffn1", 32 * 197, 3072, 768, GELU),
    ("vit bs256 ffn1", 256 * 197, 3072, 768, GELU),
    ("convnext bs32 s1 pw1", 32 * 56 * 56, 384, 96, GELU),
    ("convnext bs32 s2 pw1", 32 * 28 * 28, 768, 192, GELU),
    ("convnext bs256 s1 pw1", 256 * 56 * 56, 384, 96, GELU),
    ("convnext bs256 s3 pw1", 256 * 14 * 14, 1536, 384, GELU),
]


def chunk_rows(m: int, n: int, mb: float) -> int:
    rows = int(mb * 2**20 / (n * 2)) // 128 * 128
    return max(128, min(m, rows))


def case_rows(name, m, n, k, sig, chunk_mbs) -> list[dict]:
    dev, dtype = "cuda", torch.float16
    a = torch.randn(m, k, device=dev, dtype=dtype)
    b = (torch.randn(n, k, device=dev, dtype=dtype) / k**0.5).t()  # nn.Linear's weight, transposed
    ops = [torch.randn(n, device=dev, dtype=dtype)]
    if "full1" in sig:
        ops.append(torch.randn(m, n, device=dev, dtype=dtype))
    out = torch.empty(m, n, device=dev, dtype=dtype)
    ref = epi.reference(epi.parse(sig), epi.rows3(a.float() @ b.float(), (m, n), -1),
                        [epi.rows3(t.float(), (m, n), -1) for t in ops])

    def rows_of(t, r0, r1):
        return t[r0:r1] if t.dim() == 2 else t

    def run(rows):
        for r0 in range(0, m, rows):
            r1 = min(m, r0 + rows)
            torch.mm(a[r0:r1], b, out=out[r0:r1])
            kernels.epilogue(out[r0:r1], [rows_of(t, r0, r1) for t in ops], sig, out[r0:r1], -1)

    def mm_only(rows):
        for r0 in range(0, m, rows):
            torch.mm(a[r0:r0 + rows], b, out=out[r0:r0 + rows])

    found = []
    base = {"case": name, "M": m, "N": n, "K": k, "out_mb": m * n * 2 / 2**20}
    for mb in [None] + chunk_mbs:
        rows = m if mb is None else chunk_rows(m, n, mb)
        if mb is not None and rows >= m:
            continue
        out.fill_(float("nan"))
        run(rows)
        err = kb.rel_err(epi.rows3(out, out.shape, -1), ref)
        row = dict(base, chunk_mb=mb, rows=rows, chunks=-(-m // rows), relerr=err,
                   mm_us=kb.bench(lambda: mm_only(rows)), mm_pass_us=kb.bench(lambda: run(rows)))
        print(json.dumps(row), flush=True)
        found.append(row)
    return found


def table(rows) -> str:
    lines = ["| case | out MB | chunk MB | chunks | mm alone | mm + pass | pass | vs whole | rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    whole = {r["case"]: r["mm_pass_us"] for r in rows if r["chunk_mb"] is None}
    for r in rows:
        lines.append(f"| {r['case']} | {r['out_mb']:.0f} | {r['chunk_mb'] or 'whole'} | {r['chunks']} | "
                     f"{r['mm_us']:.1f} | {r['mm_pass_us']:.1f} | {r['mm_pass_us'] - r['mm_us']:.1f} | "
                     f"{whole[r['case']] / r['mm_pass_us']:.2f}x | {r['relerr']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="comma-separated substrings of the case names to run")
    ap.add_argument("--mb", default="4,8,12,16,24,32", help="chunk sizes, MB of output")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    wanted = [s for s in args.cases.split(",") if s]
    mbs = [float(x) for x in args.mb.split(",") if x]
    rows = []
    for case in CASES:
        if not wanted or any(s in case[0] for s in wanted):
            rows += case_rows(*case, mbs)
    with open(os.path.join(args.out, "l2_chunks.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(torch.cuda.get_device_name(), torch.__version__)
    print(table(rows))


if __name__ == "__main__":
    main()
