"""A config of our kernel that does not load on this GPU (Triton's OutOfResources, raised as it loads, before anything
runs; the heuristic configs of tuning "none" assume a Hopper's shared memory): the op runs cuDNN/cuBLAS + our epilogue
kernel instead, says so once, and does not try that config again. The error is injected here: the interpreter has
no shared memory to run out of."""
import pytest
import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from resfuse import kernels
from resfuse.ops import PATHS, fused, training

SIG = "relu(add(add(acc,c0),full1))"


@pytest.fixture
def unloadable(monkeypatch):
    """kernels.conv2d / gemm / conv2d_dgrad raising as a config too large for the GPU does; their calls counted."""
    calls = []

    def refuse(name):
        def run(*args, **kwargs):
            calls.append(name)
            raise OutOfResources(300000, 101376, "shared memory")
        return run

    for name in ("conv2d", "gemm", "conv2d_dgrad"):
        monkeypatch.setattr(kernels, name, refuse(name))
    return calls


def test_conv_gemm_and_data_gradient_fall_back_once(unloadable, capsys):
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 7, 6), torch.randn(4, 5, 3, 3)
    bias, r = torch.randn(4), torch.randn(2, 4, 7, 6)
    a, b, r2 = torch.randn(9, 5), torch.randn(5, 4), torch.randn(9, 4)
    g = torch.randn(2, 4, 7, 6)
    for _ in range(2):
        out = fused.conv2d_impl(x, w, [bias, r], SIG, [1, 1], [1, 1], [1, 1], "triton")
        ref = torch.relu(F.conv2d(x.double(), w.double(), bias.double(), padding=1) + r.double())
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        out = fused.gemm_impl(a, b, [bias, r2], SIG, [9, 4], "triton")
        torch.testing.assert_close(out.double(), torch.relu(a.double() @ b.double() + bias.double() + r2.double()),
                                   rtol=1e-5, atol=1e-5)
        out = training.conv2d_dgrad_impl(g, w, [], "acc", [2, 5, 7, 6], [1, 1], [1, 1], [1, 1], "triton")
        ref = torch.nn.grad.conv2d_input((2, 5, 7, 6), w.double(), g.double(), padding=1)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert unloadable == ["conv2d", "gemm", "conv2d_dgrad"]  # each tried once, not on the second call
    said = [line for line in capsys.readouterr().out.splitlines() if "does not fit this GPU" in line]
    assert len(said) == 3, said
    assert PATHS[("conv2d", SIG, "epilogue")] >= 2 and PATHS[("gemm", SIG, "epilogue")] >= 2
