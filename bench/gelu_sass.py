"""Count the sm_90 SASS instructions of kernels/activations.py's gelu_erf a value, for an fp16 and an fp32 output,
on a machine without a GPU (triton's ptxas and nvdisasm, through bench/ewise_sass.py's `sass`).

Entry point: `python bench/gelu_sass.py`. Each count is a 128-value kernel (4 warps: one value a thread) that loads
fp32, applies gelu_erf and stores, less the same kernel without gelu_erf; NOPs are not counted.
"""
from __future__ import annotations

import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ewise_sass import sass  # noqa: E402  bench/ewise_sass.py
from resfuse.kernels.activations import gelu_erf  # noqa: E402


@triton.jit
def gelu_kernel(x, y, OUT: tl.constexpr):
    o = tl.arange(0, 128)
    tl.store(y + o, gelu_erf(tl.load(x + o), OUT).to(y.dtype.element_ty))


@triton.jit
def copy_kernel(x, y, OUT: tl.constexpr):
    o = tl.arange(0, 128)
    tl.store(y + o, tl.load(x + o).to(y.dtype.element_ty))


def instructions(kernel, out: str) -> int:
    dtype = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}[out]
    src = ASTSource(kernel, {"x": "*fp32", "y": f"*{out}", "OUT": "constexpr"}, {(2,): dtype})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return sum(1 for line in sass(compiled).splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line) and "NOP" not in line)


def main() -> None:
    for out in ("fp16", "bf16", "fp32"):
        print(f"gelu_erf stored as {out}: {instructions(gelu_kernel, out) - instructions(copy_kernel, out)} "
              "SASS instructions a value")


if __name__ == "__main__":
    main()
