"""Compile the epilogue pass (kernels/elementwise.py, the pass after cuDNN/cuBLAS) for sm_90 on a machine without a
GPU, with the channel vector KV = 1 and with KV = 8, and count its global loads and stores by width in the SASS.

Entry point: `python bench/ewise_sass.py [--channels 72]`, with triton installed (its ptxas and nvdisasm). The
problem is a bs32 56x56 channels_last conv output with a bias + relu epilogue; 72 channels is MobileNetV3's. A
16-byte access is `.128`, a 2-byte one `.U16`.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from resfuse.kernels import codegen  # noqa: E402
from resfuse.kernels.elementwise import FAMILY  # noqa: E402

SIG = "relu(add(acc,c0))"
CONSTEXPRS = {"BM": 64, "BN": 128, "SPLIT_K": 1, "PDL": False, "PREFETCH": False}


def compile_sm90(channels: int, kv: int, hw: int = 56 * 56, batch: int = 32):
    """The kernel for that problem, its scalar arguments specialised as Triton would (1 as a constant, 16-divisible
    values marked), compiled for sm_90."""
    kernel = codegen.load(FAMILY, SIG)
    ints = {"M": batch * hw, "N": channels, "RPS": hw, "s_ss": hw * channels // kv, "s_sp": channels // kv,
            "s_sc": 1, "s_os": hw * channels // kv, "s_op": channels // kv, "s_oc": 1, "op_sn0": 0, "op_sp0": 0,
            "op_sc0": 1}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in CONSTEXPRS or name == "KV":
            sig[name], consts[(i,)] = "constexpr", kv if name == "KV" else CONSTEXPRS[name]
        elif name in ("out", "src", "op0", "ws", "tickets"):
            sig[name] = {"ws": "*fp32", "tickets": "*i32"}.get(name, "*fp16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif ints[name] in (0, 1):
            sig[name], consts[(i,)] = "constexpr", ints[name]
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})


def sass(compiled) -> str:
    """A compiled kernel's SASS, by triton's nvdisasm (bench/gelu_sass.py reads it too)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def memory_ops(compiled) -> tuple[dict, int]:
    text = sass(compiled)
    ops = collections.Counter(m.group(1) for m in re.finditer(r"\b((?:LDG|STG)\.E[.\w]*)", text))
    return dict(ops), len(re.findall(r"/\*[0-9a-f]{4}\*/", text))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", type=int, default=72)
    args = p.parse_args()
    for kv in (1, 8):
        ops, total = memory_ops(compile_sm90(args.channels, kv))
        print(f"{args.channels} channels, KV = {kv}: {total} SASS instructions; global loads and stores {ops}")


if __name__ == "__main__":
    main()
