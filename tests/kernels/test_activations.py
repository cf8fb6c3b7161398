"""Each unary epilogue op's Triton code against its float64 reference over a dense range, the tails and the
special values, through the elementwise epilogue kernel under the interpreter. tests/test_activation_values.py checks GELU
and the other typed ops value by value, also compiled on a GPU."""
import pytest
import torch

from resfuse import epilogue as epi
from resfuse.kernels import elementwise

UNARY = ["gelu", "gelu_tanh", "silu", "sigmoid", "hardswish", "hardsigmoid", "tanh", "relu"]


@pytest.mark.parametrize("op", UNARY)
def test_unary_ops_match_float64_over_the_whole_range(op):
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.randn(999) * 3,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, float("inf"), float("-inf"), float("nan")])])
    x = x.view(-1, 1)
    out = torch.full_like(x, float("nan"))
    elementwise.epilogue(x, [], f"{op}(acc)", out, -1)
    ref = epi.reference(epi.parse(f"{op}(acc)"), epi.rows3(x.double(), x.shape, -1), []).view(-1, 1)
    # float64's own 1 + erf(x) cancels below x = -5 (it returns 0 for gelu(-8.4)); there the true value is
    # below 1e-6 and the absolute tolerance covers it
    torch.testing.assert_close(out.double(), ref, rtol=4e-6, atol=2e-7, equal_nan=True)


def test_gelu_tail_keeps_its_relative_accuracy():
    """Phi(x) for x in [-5, -2], where float64's reference is still exact and fp32's 1 + erf(x) is not."""
    x = torch.linspace(-5, -2, 301).view(-1, 1)
    out = torch.full_like(x, float("nan"))
    elementwise.epilogue(x, [], "gelu(acc)", out, -1)
    ref = torch.nn.functional.gelu(x.double())
    assert ((out.double() - ref).abs() / ref.abs()).max() < 5e-6
