"""The devices a kernel test outside tests/kernels runs on: the interpreter on CPU tensors (CI), and a compiled
GPU (`TRITON_INTERPRET=0 pytest -m requires_cuda ...`), where the hardware's max, ex2 or rsqrt can differ from the
interpreter's numpy. tests/kernels' conftest skips its every test when TRITON_INTERPRET=0, so such tests live here.
Entry points: `DEVICES` (a pytest parametrisation), `skip_unless_available(device)`."""
import pytest
import torch

from resfuse import kernels

DEVICES = [pytest.param("cpu", id="interpreter"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.requires_cuda, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")])]


def skip_unless_available(device: str) -> None:
    """Skip where this process's kernels run on the other device (TRITON_INTERPRET picks one per process)."""
    if not kernels.available(torch.device(device)):
        pytest.skip(f"resfuse's kernels do not run on {device} in this process (TRITON_INTERPRET)")
