"""plan.Launcher and plan.launch: past the first launch, a kernel is called without Triton's JIT on a GPU, and every
launch still computes the right thing, fresh inputs each time; a tensor at another alignment gets its own."""
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from resfuse.kernels import launch, plan
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


@triton.jit
def _axpy(x, y, out, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, a * tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)


@pytest.mark.parametrize("device", DEVICES)
def test_launch_without_a_plan_keys_on_what_the_jit_specialises(device):
    """plan.launch: a float argument is passed each time (a new value reuses the launcher); an int or a tensor's
    alignment that the JIT specialises on (n == 1, an odd offset) gets a launcher of its own."""
    skip_unless_available(device)
    storage = torch.randn(4, 40, device=device)
    before = len(plan._LAUNCHERS)
    cases = [(0, 33, 1.5), (0, 33, -2.0), (0, 33, 0.25), (1, 33, 1.5), (0, 1, 1.5), (1, 33, -3.0)]
    for offset, n, a in cases:
        x, y = storage[0, offset:offset + n], storage[1, offset:offset + n]
        out = torch.full((n,), float("nan"), device=device)
        plan.launch(_axpy, (triton.cdiv(n, 16),), x, y, out, n, a, BLOCK=16)
        torch.testing.assert_close(out, a * x + y)
    assert len(plan._LAUNCHERS) == before + 3  # aligned n=33, odd offset n=33, n=1


def test_a_strided_1x1_conv_on_the_pointer_kernel_launches_without_pdl(monkeypatch):
    """With programmatic dependent launch, ResNet-50 bs1's CUDA graph replayed wrong where layer 4's stride-2 shortcut
    conv ran on the pointer conv kernel (thirty-eighth session, BENCHMARKS.md): that kernel's 1x1 plans launch
    without it, its 3x3 plans keep it, wherever PDL is on (here faked on, since the interpreter turns it off)."""
    monkeypatch.setattr(plan, "pdl_meta", lambda device: {"PDL": True, "launch_pdl": True})
    cl = torch.channels_last
    x = torch.randn(1, 32, 8, 8).contiguous(memory_format=cl)
    cfg = launch.ConvConfig(32, 32, 16, 2, 2, False, 4, 2)
    metas = {}
    for r, stride, pad in ((1, 2, 0), (3, 1, 1), (3, 2, 1)):
        w = torch.randn(48, 32, r, r).contiguous(memory_format=cl)
        oh = (8 + 2 * pad - r) // stride + 1
        out = torch.empty(1, 48, oh, oh).contiguous(memory_format=cl)
        p = launch._conv_plan(x, w, [], "acc", [stride, stride], [pad, pad], [1, 1], out, cfg)
        assert p.kernel.kernel.__name__ == "resfuse_conv2d_fprop"
        metas[(r, stride)] = p.meta
    assert metas[(1, 2)]["PDL"] is False and "launch_pdl" not in metas[(1, 2)]
    assert metas[(3, 1)]["PDL"] is True and metas[(3, 2)]["launch_pdl"] is True
