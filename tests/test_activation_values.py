"""The activations whose Triton code depends on the stored dtype (kernels/activations.py) value by value against
float64, through the epilogue kernel on an fp32 accumulator: GELU's erfc fits stored as fp32 (the degree-9 fit) and
as fp16 or bf16 (the degree-5 fit); the logistic ones (silu, sigmoid, tanh-approximated GELU) and hardswish's and
hardsigmoid's sixth, stored as fp32 (IEEE divisions) and as fp16 or bf16 (none). Under the interpreter on CPU tensors
(CI), and compiled on a GPU (`TRITON_INTERPRET=0 pytest -m requires_cuda tests/test_activation_values.py`), where
ex2 and rsqrt are the hardware's approximations, not numpy's. Outside tests/kernels, whose tests are all skipped when
TRITON_INTERPRET=0."""
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


def _u(x: torch.Tensor) -> torch.Tensor:
    return math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)


def _fp32_range(v: torch.Tensor) -> torch.Tensor:
    """v, infinite where it is past fp32's largest number (eager's fp32 math overflows there)."""
    return torch.where(v.abs() > torch.finfo(torch.float32).max, v * math.inf, v)


# each op's exact value in float64, written where it does not cancel: eager's GELU x * (1 + erf(x / sqrt 2)) / 2 as
# erfc (torch's float64 ndtr is 0 below x = -14), the tanh GELU's 0.5 x (1 + tanh(u)) as x * sigmoid(2u); hardswish's
# x * clamp(x + 3, 0, 6) overflows before its division by 6, in eager's fp32 as in the kernel
EXACT = {
    "gelu": lambda x: x * torch.special.erfc(-x / math.sqrt(2)) / 2,
    "gelu_tanh": lambda x: x / (1 + torch.exp(-2 * _u(x))),
    "silu": lambda x: x / (1 + torch.exp(-x)),
    "sigmoid": lambda x: 1 / (1 + torch.exp(-x)),
    "hardswish": lambda x: _fp32_range(x * torch.clamp(x + 3, 0, 6)) / 6,
    "hardsigmoid": lambda x: torch.clamp(x + 3, 0, 6) / 6,
}
# the share of fp16/bf16 values that may round to a neighbour of the exact value's rounding: GELU's degree-5 fit is
# good to 1.1e-5, rsqrt(y)^2 for 1 / y to 3e-7, a multiply by 1/6 for the division by 6 to 1.5 fp32 ulps; tanh-GELU's
# z = 2u, rounded in fp32, is off by up to 1e-5 relative near z = -88, which misrounds 0.6% of these bf16 values
# (an fp32 emulation on the CPU; an H200 failed 0.5%) where eager's 0.5 x (1 + tanh(u)) cancels and misrounds 16%
NEIGHBOURS = {"gelu": 0.02, "gelu_tanh": 0.02, "silu": 0.005, "sigmoid": 0.005, "hardswish": 0.005,
              "hardsigmoid": 0.005}


def _stored(op: str, x: torch.Tensor, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's op(x) stored as `dtype`, and the exact value, both float64 and flat."""
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=device)
    kernels.epilogue(x.to(device), [], f"{op}(acc)", out, -1)
    return out.cpu().double().flatten(), EXACT[op](x.double().flatten())


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_erf_matches_float64_value_by_value(device):
    skip_unless_available(device)
    x = _inputs()
    got, exact = _stored("gelu", x, torch.float32, device)
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
@pytest.mark.parametrize("op", ["gelu_tanh", "silu", "sigmoid", "hardswish", "hardsigmoid"])
def test_fp32_activations_match_float64(device, op):
    """Stored as fp32, through IEEE divisions: within 2e-5 of the exact value (exp(-z)'s argument is rounded to fp32,
    so its relative error grows with |z|, up to 1e-5 at z = 66, tanh-GELU's at x = -9, where the value is 1e-29 and
    the form before, 0.5 x (1 + tanh(u)), cancelled to 0); specials, zeros' signs, as eager's."""
    skip_unless_available(device)
    got, exact = _stored(op, _inputs(), torch.float32, device)
    nan = exact.isnan()
    assert torch.equal(got.isnan(), nan), "NaN where eager has none, or a NaN lost (x = nan or -inf)"
    got, exact = got[~nan], exact[~nan]
    assert torch.equal(got.isinf(), exact.isinf()) and torch.equal(got[got.isinf()], exact[exact.isinf()])
    assert torch.equal(got[exact == 0].signbit(), exact[exact == 0].signbit()), "the sign of a zero"
    big = exact.isfinite() & (exact.abs() > 1e-30)
    assert ((got - exact)[big].abs() / exact[big].abs()).max() <= 2e-5
    assert (got - exact)[exact.abs() <= 1e-30].abs().max() <= 1e-30


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", list(EXACT))
def test_half_activations_round_as_the_exact_value_does_but_for_a_few_neighbours(device, dtype, op):
    """Stored as fp16 or bf16, every value is the float64 value rounded to that dtype or one of its two neighbours,
    and at most NEIGHBOURS[op] of them a neighbour (bf16 on a GPU only); specials and zeros' signs as eager's; below
    1e-37 (bf16 only) within 1e-37."""
    skip_unless_available(device)
    got, exact = _stored(op, _inputs(), dtype, device)
    nan = exact.isnan()
    assert torch.equal(got.isnan(), nan)
    got, exact = got[~nan], exact[~nan]
    assert torch.equal(got[exact == 0].signbit(), exact[exact == 0].signbit()), "the sign of a zero"
    rounded = exact.to(dtype)
    up, down = (torch.nextafter(rounded, torch.full_like(rounded, v)).double() for v in (math.inf, -math.inf))
    ok = (got == rounded.double()) | (got == up) | (got == down) | (got.isinf() & (got == exact))
    ok |= (exact.abs() <= 1e-37) & ((got - exact).abs() <= 1e-37)  # bf16's range: fp32's subnormals, as above
    assert ok.all(), f"x's {op} {exact[~ok][:5].tolist()} stored as {got[~ok][:5].tolist()}"
    if dtype == torch.float16 or device == "cuda":  # the interpreter truncates fp32 to bf16: half would differ
        assert (got != rounded.double()).double().mean() <= NEIGHBOURS[op]
