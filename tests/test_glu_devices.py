"""A GLU's paired epilogue (epilogue.paired, kernels/codegen._pairing) on the interpreter and on a compiled GPU, where
the split of the tensor-core accumulator's columns is the compiler's own: every GEMM mainloop, split or not."""
import pytest
import torch

from resfuse import epilogue as epi
from resfuse.kernels import launch
from tests.kernel_devices import DEVICES, skip_unless_available

CONFIGS = {"pointer": dict(), "pointer split 3": dict(split_k=3), "tma": dict(tma=True),
           "tma split 2": dict(tma=True, split_k=2), "persistent": dict(tma=True, persistent=2)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mainloop", CONFIGS)
@pytest.mark.parametrize("sig", ["mul(silu(acc),up)", "add(mul(up,gelu(acc)),full0)"])
def test_paired_columns_on_every_mainloop(device, mainloop, sig):
    skip_unless_available(device)
    dtype = torch.float16 if device == "cuda" else torch.float32
    m, c, k = 45, 40, 64
    a = torch.randn(m, k, device=device, dtype=dtype)
    w = (torch.randn(2 * c, k, device=device) / k ** 0.5).to(dtype)  # gate row j, up row j, interleaved
    residual = torch.randn(m, c, device=device, dtype=dtype)
    operands = [residual] if "full0" in sig else []
    cfg = launch.GemmConfig(32, 32, 32, 2, **{"split_k": 1, "num_warps": 4, "num_stages": 2, **CONFIGS[mainloop]})
    out = torch.full((m, c), float("nan"), device=device, dtype=dtype)
    launch.gemm(a, w.t(), operands, sig, out, cfg)
    acc = (a.double() @ w.double().t()).unsqueeze(0)
    ref = epi.reference(epi.parse(sig), acc, [r.double().unsqueeze(0) for r in operands])[0]
    tol = 1e-2 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
