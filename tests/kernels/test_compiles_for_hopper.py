"""The image conv's kernels compile for sm_90 (Hopper) on this CPU machine, through Triton's compiler down to
cubin, for fp16 inputs and for autocast's fp32 ones, bare and with epilogues. The interpreter runs every other
test, and it accepts what compiled Triton refuses: the padding kernel's first form named tensors of two shapes `c` in the two branches of
an if, which only the GPU's compile caught (BENCHMARKS.md, thirty-third session). A fresh process, as the
interpreter switch is process-wide."""
import os
import subprocess
import sys

SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from resfuse.kernels import conv2d_image as k

def build(fn, ints, ptrs, consts):
    sig = {**{n: "i32" for n in ints}, **ptrs, **{n: "constexpr" for n in consts}}
    where = {(list(fn.arg_names).index(n),): v for n, v in consts.items()}
    triton.compile(ASTSource(fn, sig, constexprs=where), target=GPUTarget("cuda", 90, 32))

for x, half in (("*fp16", "*fp16"), ("*fp32", "*fp16"), ("*fp32", "*bf16")):
    for big in (False, True):
        build(k.pad_image_kernel, "PIXELS C H W HP WP PH PW K S s_xn s_xc s_xh s_xw s_wk s_wc s_wr s_ws".split(),
              {"x": x, "w": x, "xp": half, "wp": half},
              {"BIG": big, "BM": k.PAD_BM, "CP": 4, "KP": 32, "BK": 64, "PDL": True})
from resfuse.kernels import codegen
for signature, operands in (("acc", 0), ("relu(bn[#1e-05](acc,c0,c1,c2,c3))", 4), ("add(acc,c0)", 1)):
    conv = codegen.load_source("image_conv", signature, lambda: k.source(signature))
    ints = "M OH OW s_xn s_xh R K".split() + [f"op_{d}{i}" for i in range(operands) for d in ("sn", "sp", "sc")]
    for half in ("*fp16", "*bf16"):
        for sw, align in ((2, 8), (1, 4)):
            build(conv, ints, {"xp": half, "wp": half, "y": half, **{f"op{i}": "*fp32" for i in range(operands)}},
                  {"SH": 2, "SW": sw, "TAPS": 28, "ALIGN": align, "BIG": sw == 1, "BM": k.BM, "CP": 4, "KP": 32,
                   "BK": 64, "PRECISION": "ieee", "PDL": True})
print("compiled")
'''


def test_image_conv_kernels_compile_for_hopper():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
