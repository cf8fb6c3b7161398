"""Each unary epilogue op's Triton code against its float64 reference over a dense range, the tails and the
special values, through the elementwise epilogue kernel under the interpreter; and GELU's erfc fit
(kernels/activations.py) value by value, also compiled on a GPU (`TRITON_INTERPRET=0 pytest -m requires_cuda
tests/kernels/test_activations.py`), where ex2 and rsqrt are the hardware's approximations, not numpy's."""
import math

import pytest
import torch

from resfuse import epilogue as epi
from resfuse import kernels
from resfuse.kernels import launch

UNARY = ["gelu", "gelu_tanh", "silu", "sigmoid", "hardswish", "hardsigmoid", "tanh", "relu"]


@pytest.mark.parametrize("op", UNARY)
def test_unary_ops_match_float64_over_the_whole_range(op):
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.randn(999) * 3,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, float("inf"), float("-inf"), float("nan")])])
    x = x.view(-1, 1)
    out = torch.full_like(x, float("nan"))
    launch.epilogue(x, [], f"{op}(acc)", out, -1)
    ref = epi.reference(epi.parse(f"{op}(acc)"), epi.rows3(x.double(), x.shape, -1), []).view(-1, 1)
    # float64's own 1 + erf(x) cancels below x = -5 (it returns 0 for gelu(-8.4)); there the true value is
    # below 1e-6 and the absolute tolerance covers it
    torch.testing.assert_close(out.double(), ref, rtol=4e-6, atol=2e-7, equal_nan=True)


def test_gelu_tail_keeps_its_relative_accuracy():
    """Phi(x) for x in [-5, -2], where float64's reference is still exact and fp32's 1 + erf(x) is not."""
    x = torch.linspace(-5, -2, 301).view(-1, 1)
    out = torch.full_like(x, float("nan"))
    launch.epilogue(x, [], "gelu(acc)", out, -1)
    ref = torch.nn.functional.gelu(x.double())
    assert ((out.double() - ref).abs() / ref.abs()).max() < 5e-6

DEVICES = [pytest.param("cpu", id="interpreter"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.requires_cuda, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")])]
SPECIALS = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-40, 1e30, -1e30, 1e4, -1e4, 9999.0,
            -9999.0, 3.4e38, -3.4e38]
# (lowest x, bound on |gelu - exact| / |exact|): the fit's 1.2e-7 plus fp32's rounding of x^2 / 2 in the
# exponent, which grows with x^2 where Phi(x) is tiny
BOUNDS = [(-4.0, 2e-6), (-8.0, 1e-5), (-15.0, 4e-5)]


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_erf_matches_float64_value_by_value(device):
    if not kernels.available(torch.device(device)):
        pytest.skip(f"resfuse's kernels do not run on {device} in this process (TRITON_INTERPRET)")
    x = torch.cat([torch.linspace(-15, 15, 6001), torch.randn(3000) * 4, -torch.logspace(-7, 1.15, 500),
                   torch.logspace(-7, 1.15, 500), torch.tensor(SPECIALS)])
    x = x[torch.randperm(len(x))]
    x = torch.cat([x, torch.randn(-len(x) % 37)]).view(-1, 37)  # 37 columns: no tile divides them
    out = torch.full_like(x, float("nan"), device=device)
    kernels.epilogue(x.to(device), [], "gelu(acc)", out, -1)
    got, x = out.cpu().double().flatten(), x.double().flatten()
    # eager's x * (1 + erf(x / sqrt 2)) / 2 without its cancellation (torch's float64 ndtr is 0 below x = -14)
    exact = x * torch.special.erfc(-x / math.sqrt(2)) / 2

    nan = exact.isnan()
    assert torch.equal(got.isnan(), nan), "NaN where eager has none, or a NaN lost (x = nan or -inf)"
    got, exact, x = got[~nan], exact[~nan], x[~nan]
    assert torch.equal(got.isinf(), exact.isinf()) and torch.equal(got[got.isinf()], exact[exact.isinf()])
    assert torch.equal(got[exact == 0].signbit(), exact[exact == 0].signbit()), "the sign of a zero"
    finite = exact.isfinite() & (exact.abs() > 1e-37)
    rel = (got - exact).abs() / exact.abs()
    for lowest, bound in BOUNDS:
        inside = finite & (x >= lowest)
        assert rel[inside].max() <= bound, f"x >= {lowest}: {rel[inside].max():.2e} > {bound}"
    assert ((got - exact)[exact.abs() <= 1e-37]).abs().max() <= 1e-37
