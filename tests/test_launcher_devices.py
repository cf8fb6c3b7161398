"""plan.Launcher: past a plan's first launch, its kernel is called without Triton's JIT on a GPU, and every launch
still computes the right thing, fresh inputs each time; a tensor at another alignment gets a plan of its own."""
import pytest
import torch
import torch.nn.functional as F

from resfuse.kernels import launch
from tests.kernel_devices import DEVICES, skip_unless_available

SIG = "relu(add(add(acc,c0),full1))"


def _reference(x, w, bias, r, padding):
    return torch.relu(F.conv2d(x.double(), w.double(), bias.double(), padding=padding) + r.double())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["1x1 as a persistent TMA GEMM", "3x3 pointer mainloop"])
def test_every_launch_is_right_and_later_ones_skip_the_jit(device, kind):
    skip_unless_available(device)
    cuda = device == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    cl = torch.channels_last
    one = kind.startswith("1x1")
    if one:
        cfg, r_size, pad = launch.GemmConfig(64, 32, 32, 2, 1, 4, 2, tma=True, persistent=2), 1, 0
    else:
        cfg, r_size, pad = launch.ConvConfig(32, 32, 16, 2, 1, False, 4, 2), 3, 1
    w = torch.randn(40, 24, r_size, r_size, device=device, dtype=dtype).contiguous(memory_format=cl)
    bias = torch.randn(40, device=device, dtype=dtype)
    plans = len(launch._PLANS)
    for _ in range(3):
        x = torch.randn(3, 24, 7, 5, device=device, dtype=dtype).contiguous(memory_format=cl)
        r = torch.randn(3, 40, 7, 5, device=device, dtype=dtype).contiguous(memory_format=cl)
        out = torch.full((3, 40, 7, 5), float("nan"), device=device, dtype=dtype).contiguous(memory_format=cl)
        launch.conv2d(x, w, [bias, r], SIG, [1, 1], [pad, pad], [1, 1], out, cfg)
        tol = 2e-2 if cuda else 1e-4
        torch.testing.assert_close(out.double(), _reference(x, w, bias, r, pad), rtol=tol, atol=tol)
    assert len(launch._PLANS) == plans + 1
    launcher = next(reversed(launch._PLANS.values())).kernel
    assert bool(launcher.direct) == cuda  # the interpreter's JIT returns no compiled kernel to call


@pytest.mark.parametrize("device", DEVICES)
def test_an_operand_at_another_alignment_gets_its_own_plan(device):
    """The JIT specialises a pointer on its 16-byte alignment, so a direct launch must never see a tensor aligned
    otherwise than its plan's first: plan_key tells them apart."""
    skip_unless_available(device)
    dtype = torch.float16 if device == "cuda" else torch.float32
    x = torch.randn(2, 8, 4, 4, device=device, dtype=dtype)
    w = torch.randn(16, 8, 3, 3, device=device, dtype=dtype)
    storage = torch.randn(2 * 16 * 4 * 4 + 1, device=device, dtype=dtype)
    bias = torch.randn(16, device=device, dtype=dtype)
    cfg = launch.ConvConfig(32, 16, 16, 2, 1, False, 4, 2)
    plans = len(launch._PLANS)
    for offset in (0, 1, 0, 1):
        r = storage[offset:offset + 2 * 16 * 4 * 4].view(2, 16, 4, 4)
        out = torch.full((2, 16, 4, 4), float("nan"), device=device, dtype=dtype)
        launch.conv2d(x, w, [bias, r], SIG, [1, 1], [1, 1], [1, 1], out, cfg)
        tol = 2e-2 if device == "cuda" else 1e-4
        torch.testing.assert_close(out.double(), _reference(x, w, bias, r, 1), rtol=tol, atol=tol)
    assert len(launch._PLANS) == plans + 2
