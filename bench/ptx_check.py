"""Compile generated GEMM kernels for Hopper (sm_90) without a GPU and count what the PTX uses.

Entry point: `python bench/ptx_check.py [--signature "relu(add(acc,c0))"]`. Runs on a CPU machine with the
triton wheel (its CUDA backend ships ptxas). For the pointer mainloop and the TMA mainloop (both B
orientations) it prints the PTX size and the count of TMA bulk tensor copies (cp.async.bulk.tensor) and of
warpgroup MMAs (wgmma.mma_async). A compile check, not a timing: speed needs the GPU machine.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from resfuse import epilogue as epi  # noqa: E402
from resfuse.kernels import codegen, matmul  # noqa: E402
from resfuse.kernels.epilogue_source import triton_params  # noqa: E402


def operand_types(signature: str) -> dict:
    return {name: ("*fp16" if name.startswith("op") and name[2:].isdigit() else "i32")
            for name in triton_params(epi.parse(signature))}


def compile_ptx(family, signature: str, types: dict, constexprs: dict, num_warps=8, num_stages=3) -> str:
    kernel = codegen.load(family, signature)
    sig = {"out": "*fp16", "ws": "*fp16", "tickets": "*fp16", **types, family.s_out_c: "i32",
           **operand_types(signature), **{c: "constexpr" for c in (*family.constexprs, "PDL", "PREFETCH")}}
    src = ASTSource(kernel, sig, constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["ptx"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--signature", default="relu(add(acc,c0))")
    args = parser.parse_args()
    tile = {"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8, "SPLIT_K": 1, "PRECISION": "tf32", "PDL": False,
            "PREFETCH": False}
    pointer_args = {n: "i32" for n in matmul.FAMILY.args}
    pointer_args.update(a="*fp16", b="*fp16")
    cases = [("pointer", matmul.FAMILY, pointer_args, {**tile, "EVEN_K": True})]
    for b_kn in (True, False):
        box_b = "[64, 128]" if b_kn else "[128, 64]"
        types = {n: "i32" for n in matmul.TMA_FAMILY.args}
        types.update(a_desc="tensordesc<fp16[128, 64]>", b_desc=f"tensordesc<fp16{box_b}>", b_mat="*fp16")
        cases.append((f"tma B_KN={b_kn}", matmul.TMA_FAMILY, types, {**tile, "B_KN": b_kn}))
    for name, family, types, constexprs in cases:
        ptx = compile_ptx(family, args.signature, types, constexprs)
        print(f"{name:16s} ptx {len(ptx):7d} chars  tma copies {ptx.count('cp.async.bulk.tensor'):3d}  "
              f"wgmma {ptx.count('wgmma.mma_async'):3d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
