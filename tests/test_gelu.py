"""GELU's erfc fits (kernels/activations.py's gelu_erf) value by value against float64, through the epilogue kernel
on an fp32 accumulator, stored as fp32 (the degree-9 fit) and as fp16 or bf16 (the degree-5 fit): under the
interpreter on CPU tensors (CI), and compiled on a GPU (`TRITON_INTERPRET=0 pytest -m requires_cuda
tests/test_gelu.py`), where ex2 and rsqrt are the hardware's approximations, not numpy's. Outside tests/kernels,
whose tests are all skipped when TRITON_INTERPRET=0."""
import math

import pytest
import torch

from resfuse import kernels

from .kernel_devices import DEVICES, skip_unless_available

# on purpose, and numpy warns of both under the interpreter: x * x overflows to inf for |x| > 1.8e19 (exp2(-inf)
# is 0), and -inf * Phi = -inf * 0 is NaN, as in eager
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
SPECIALS = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-40, 1e30, -1e30, 1e4, -1e4, 9999.0,
            -9999.0, 3.4e38, -3.4e38]
# (lowest x, bound on |gelu - exact| / |exact|): the fit's 1.2e-7 plus fp32's rounding of x^2 / 2 in the
# exponent, which grows with x^2 where Phi(x) is tiny
BOUNDS = [(-4.0, 2e-6), (-8.0, 1e-5), (-15.0, 4e-5)]


def _inputs() -> torch.Tensor:
    x = torch.cat([torch.linspace(-15, 15, 6001), torch.randn(3000) * 4, -torch.logspace(-7, 1.15, 500),
                   torch.logspace(-7, 1.15, 500), torch.tensor(SPECIALS)])
    x = x[torch.randperm(len(x))]
    return torch.cat([x, torch.randn(-len(x) % 37)]).view(-1, 37)  # 37 columns: no tile divides them


def _gelu(x: torch.Tensor, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's GELU of x stored as `dtype`, and eager's exact value, both float64 and flat."""
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=device)
    kernels.epilogue(x.to(device), [], "gelu(acc)", out, -1)
    x = x.double().flatten()
    # eager's x * (1 + erf(x / sqrt 2)) / 2 without its cancellation (torch's float64 ndtr is 0 below x = -14)
    return out.cpu().double().flatten(), x * torch.special.erfc(-x / math.sqrt(2)) / 2


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_erf_matches_float64_value_by_value(device):
    skip_unless_available(device)
    x = _inputs()
    got, exact = _gelu(x, torch.float32, device)
    x = x.double().flatten()

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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gelu_rounds_as_the_exact_value_does_but_for_a_few_neighbours(device, dtype):
    """Stored as fp16 or bf16, every value is the float64 value rounded to that dtype or one of its two neighbours,
    and at most 2% are a neighbour (the fit's 1.1e-5 against the dtype's spacing of 1e-3 or 8e-3; bf16 on a GPU
    only); specials as eager's; below 1e-37 (bf16 only) within 1e-37."""
    skip_unless_available(device)
    got, exact = _gelu(_inputs(), dtype, device)
    nan = exact.isnan()
    assert torch.equal(got.isnan(), nan)
    got, exact = got[~nan], exact[~nan]
    rounded = exact.to(dtype)
    up, down = (torch.nextafter(rounded, torch.full_like(rounded, v)).double() for v in (math.inf, -math.inf))
    ok = (got == rounded.double()) | (got == up) | (got == down) | (got.isinf() & (got == exact))
    ok |= (exact.abs() <= 1e-37) & ((got - exact).abs() <= 1e-37)  # bf16's range: fp32's subnormals, as above
    assert ok.all(), f"x's GELU {exact[~ok][:5].tolist()} stored as {got[~ok][:5].tolist()}"
    if dtype == torch.float16 or device == "cuda":  # the interpreter truncates fp32 to bf16: half would differ
        assert (got != rounded.double()).double().mean() <= 0.02
