"""Our kernels compile for sm_90 (Hopper) on this CPU machine, through Triton's compiler down to cubin. The
interpreter runs every other test, and it accepts what compiled Triton refuses: the image conv's padding kernel
first named tensors of two shapes `c` in the two branches of an if, which only the GPU's compile caught
(BENCHMARKS.md, thirty-third session).

How, without a GPU: a fresh process (the interpreter switch is process-wide) tells Triton its driver is a Hopper
GPU's (`FakeHopper`: JITFunction.run asks the driver only for a device, a stream and a target before its compile
hook), records what each tuning candidate's launches would compile (tuning/precompile.record, as the tuner's workers
do), and compiles one of each distinct kernel (tile sizes aside; split-K, TMA, persistent and store variants kept)
with tuning/workers.compile_spec. The calls cover every kernel family the tuner offers for a fused conv, GEMM (plain
and swapped), chain and shortcut, each with an epilogue, and the image conv (bare, and cast from autocast's fp32),
with programmatic dependent launch on, as on a Hopper GPU, and the weight prefetch of the families that have one in
their PTX."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'bench')!r})\n" + r'''
import re
import torch
import fake_hopper

fake_hopper.install()
from resfuse.kernels import conv2d_image
from resfuse.ops import chain as chain_op, fused, shortcut as shortcut_op
from resfuse.providers import triton as provider
from resfuse.tuning import precompile, workers
from resfuse.tuning.choose import triton_launches

cl = torch.channels_last
def t(*shape, dtype=torch.half):
    v = torch.randn(*shape, dtype=dtype)
    return v.contiguous(memory_format=cl) if v.dim() == 4 else v
def bn(c):
    return [t(c) for _ in range(4)]
BN, SHIFT = "relu(bn[#1e-05](acc,c0,c1,c2,c3))", "bn[#1e-05](acc,c0,c1,c2,c3)"
TAIL = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))"
x16, x64 = t(2, 16, 9, 9), t(2, 64, 8, 8)
calls = [
    fused.call_of("conv2d", (x16, t(32, 16, 3, 3)), bn(32), BN, ([1, 1], [1, 1], [1, 1])),
    fused.call_of("conv2d", (x16, t(32, 16, 3, 3)), bn(32), BN, ([2, 2], [1, 1], [1, 1])),
    fused.call_of("conv2d", (t(2, 16, 4, 4), t(32, 16, 3, 3)), bn(32), BN, ([1, 1], [1, 1], [1, 1])),  # split-K
    fused.call_of("conv2d", (x64, t(64, 64, 1, 1)), [*bn(64), t(2, 64, 8, 8)], TAIL, ([1, 1], [0, 0], [1, 1])),
    fused.call_of("conv2d", (t(1, 64, 7, 7), t(256, 64, 1, 1)), [*bn(256), t(1, 256, 7, 7)], TAIL,
                  ([1, 1], [0, 0], [1, 1])),  # one image, few rows: swapped configs too
    fused.call_of("conv2d", (x16, t(16, 1, 3, 3)), bn(16), BN, ([1, 1], [1, 1], [1, 1])),  # depthwise
    fused.call_of("conv2d", (t(2, 3, 16, 16), t(32, 3, 3, 3)), bn(32), BN, ([2, 2], [1, 1], [1, 1])),  # image
    fused.call_of("gemm", (t(64, 64), t(128, 64).t()), [t(128)], "gelu(add(acc,c0))", ([64, 128],)),
    chain_op.call_of(x64, t(256, 64, 1, 1), bn(256), BN, t(64, 256, 1, 1), bn(64), BN),
    shortcut_op.call_of(x64, t(256, 64, 1, 1), [*bn(256), t(2, 256, 8, 8)], TAIL, 4, t(2, 64, 16, 16),
                        t(256, 64, 1, 1), bn(256), SHIFT, [2, 2]),
]
launches = [f for call in calls for f in triton_launches(provider.candidates(call, "fast"))]
swapped = [c for call in calls for c in provider.candidates(call, "fast") if c.config.get("swap")]
assert len(swapped) >= 4, len(swapped)  # the bs1 conv's and the GEMM's
image, out = t(2, 3, 16, 16, dtype=torch.float32), t(2, 64, 8, 8)
launches.append(lambda: conv2d_image.image_conv(image, t(64, 3, 7, 7, dtype=torch.float32), (2, 2), (3, 3), out))
specs = precompile.record(launches)

TILE = re.compile(r"^(B[A-Z0-9]*|GROUP_M)$")  # block sizes: a kernel compiles the same way at each
def kind(spec):
    names = list(spec["signature"])
    consts = tuple(sorted((names[i[0]], v) for i, v in spec["constants"].items() if not TILE.match(names[i[0]])))
    types = tuple(re.sub(r"\[.*?\]", "", str(ty)) for ty in spec["signature"].values())
    return spec["module"], spec["name"], consts, types
kinds = {}
for spec in specs:
    kinds.setdefault(kind(spec), spec)
assert len(specs) > 50 and len(kinds) > 15, (len(specs), len(kinds))
failed, prefetching = [], set()
WEIGHTS = {"resfuse_conv2d_fprop", "resfuse_conv2d_tma", "resfuse_gemm_tma", "resfuse_gemm_tma_persistent",
           "resfuse_gemm (swapped)"}
for spec in kinds.values():
    try:
        ptx = workers.compiled(spec).asm["ptx"]
    except Exception as e:
        failed.append(f"{spec['name']} ({spec['module']}): {type(e).__name__}: {str(e)[:1500]}")
        continue
    names = list(spec["signature"])
    consts = {names[i[0]]: v for i, v in spec["constants"].items()}
    name = spec["name"] + " (swapped)" * ("(swapped)." in open(spec["path"]).read())  # codegen's header says
    if name in WEIGHTS and consts.get("PREFETCH") and not consts.get("B_KN"):
        assert "cp.async.bulk.prefetch.L2.global" in ptx, name  # the weight tile asked of L2
        prefetching.add(name)
    elif spec["name"] == "resfuse_gemm":  # the plain pointer GEMM has no weight prefetch
        assert "cp.async.bulk.prefetch.L2.global" not in ptx
print(f"compiled {len(kinds)} kernels of {len(specs)} launches")
assert not failed, "\n".join(failed)
assert prefetching == WEIGHTS, prefetching
'''


def test_kernels_compile_for_hopper(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
