"""Activations written out in elementwise ops (HF transformers' gelu_new, FastGELU, the Python erf GELU,
x * sigmoid(x), QuickGELU) after a linear layer: replaced by their one op, fused into the GEMM, and eager's function."""
import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import resfuse
from resfuse.passes.activations import FORMULAS

from .helpers import against_float64, rel

FUSED = {"gelu_new": ["gelu"], "gelu_accurate": ["gelu"], "gelu_fast": ["gelu"], "gelu_python": ["gelu"],
         "silu": ["silu"], "quick_gelu": ["mul", "silu", "div"]}  # quick_gelu: silu(1.702 x) / 1.702


class Mlp(nn.Module):
    def __init__(self, formula, width, hidden, bias):
        super().__init__()
        self.up, self.down, self.act = nn.Linear(width, hidden, bias=bias), nn.Linear(hidden, width), formula

    def forward(self, x):
        return self.down(self.act(self.up(x)))


@pytest.mark.parametrize("index", range(len(FORMULAS)), ids=lambda i: f"{FORMULAS[i][0]}{i}")
@settings(max_examples=3, deadline=None)
@given(rows=st.integers(1, 19), width=st.sampled_from([8, 12, 24]), hidden=st.sampled_from([16, 40]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_a_written_out_activation_fuses_into_its_gemm(index, rows, width, hidden, bias, seed):
    name, formula, _ = FORMULAS[index]
    torch.manual_seed(seed)
    mlp = Mlp(formula, width, hidden, bias).eval()
    x = torch.randn(2, rows, width) * 2  # wide enough to reach both tails of the activation
    out, ref, report = against_float64(mlp, x)
    assert report.errors == []
    # named by the first formula of the same graph (gelu_accurate's ints may match gelu_new's floats)
    assert sum("1 " in r and "written out in elementwise ops" in r for r in report.rewrites) == 1, report.rewrites
    up = [f for f in report.fusions if f.anchor == "gemm" and f.shapes["out"][-1] == hidden]
    assert len(up) == 1 and up[0].ops == ["bias"] * bias + FUSED[name] and up[0].ran == "triton"
    assert rel(out, ref) < 1e-5


def test_a_formula_whose_inner_value_is_read_elsewhere_stays_as_written():
    def act_and_tanh(h):  # the formula's tanh is returned too: replacing the formula would still need it
        t = torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0)))
        return 0.5 * h * (1.0 + t), t

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 16)

        def forward(self, x):
            return act_and_tanh(self.up(x))

    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(5, 8)
    out, ref, report = against_float64(net, x)
    assert not any("written out" in r for r in report.rewrites)
    assert all(rel(a, b) < 1e-5 for a, b in zip(out, ref))


@pytest.mark.parametrize("index", [0, 3])  # gelu_new, gelu_python
def test_training_with_a_written_out_activation_matches_eager(index):
    """A training forward saves the formula's inner values for its backward, so it stays as written; the step's
    loss and gradients are eager's."""
    torch.manual_seed(index)
    mlp = Mlp(FORMULAS[index][1], 8, 16, True).train()
    twin = copy.deepcopy(mlp)
    x = torch.randn(3, 5, 8)
    torch._dynamo.reset()
    compiled = resfuse.compile(mlp, interpret=True)
    loss, ref = compiled(x).square().sum(), twin(x).square().sum()
    loss.backward()
    ref.backward()
    assert compiled.resfuse_report.errors == [] and rel(loss, ref) < 1e-5
    for (name, p), q in zip(mlp.named_parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) < 1e-4, name


def test_fp16_gelu_new_rounds_once_and_stays_within_eagers_error():
    """In fp16 eager rounds after each of the formula's eight ops; the fused GEMM rounds once. Against float64 the
    fused output is no further than eager's."""
    torch.manual_seed(1)
    mlp = Mlp(FORMULAS[0][1], 16, 64, True).eval()
    x = torch.randn(4, 9, 16) * 2
    ref = mlp.double()(x.double())
    half = mlp.half()
    torch._dynamo.reset()
    compiled = resfuse.compile(half, interpret=True)
    with torch.no_grad():
        out, eager = compiled(x.half()), half(x.half())
    assert any("gelu_new" in r for r in compiled.resfuse_report.rewrites)
    assert rel(out, ref) <= 1.5 * rel(eager, ref)
