"""sink_permutes: elementwise ops after a permuted conv/GEMM move above the permute, values and strides unchanged,
and a ConvNeXt block's layer scale and residual add then fuse into its down-projection."""
import copy

import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import resfuse
from resfuse.config import Config
from resfuse.passes import PassContext
from resfuse.passes.legality import same_strides
from resfuse.passes.permutes import PERMUTE, sink_permutes
from resfuse.passes.report import Report

from .helpers import rel, run

OPS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul,
       "div": lambda a, b: a / (b.abs() + 1 if torch.is_tensor(b) else b)}
UNARY = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "sigmoid": torch.sigmoid}


@st.composite
def chains(draw):
    """A GEMM viewed as [B, *rest, N], permuted, then 1-3 elementwise steps with operands of every kind."""
    rank = draw(st.sampled_from([3, 4]))
    shape = [draw(st.integers(1, 4)) for _ in range(rank - 1)] + [draw(st.sampled_from([3, 5, 8]))]
    perm = draw(st.permutations(range(rank)))
    permuted = [shape[p] for p in perm]
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            steps.append((draw(st.sampled_from(sorted(UNARY))), None, False))
            continue
        kind = draw(st.sampled_from(["scalar", "vector", "full", "full-contiguous"]))
        if kind == "scalar":
            operand = draw(st.sampled_from([0.5, -2.0]))
        elif kind == "vector":  # per one dim of the permuted value, broadcast from a lower rank
            dim = draw(st.integers(0, rank - 1))
            operand = [permuted[dim]] + [1] * (rank - 1 - dim)
        else:
            operand = kind  # a tensor shaped like the permuted value; laid out like it, or contiguous
        # the operand first or second: the first input's layout decides the output's where the two differ
        steps.append((draw(st.sampled_from(sorted(OPS))), operand, draw(st.booleans())))
    return shape, list(perm), steps


def build(shape, perm, steps):
    k = 6

    def fn(a, w, *operands):
        y = (a @ w).view(shape).permute(perm)
        for (op, operand, first), t in zip(steps, operands):
            other = operand if t is None else t
            y = UNARY[op](y) if operand is None else OPS[op](other, y) if first else OPS[op](y, other)
        return y

    a, w = torch.randn(torch.Size(shape[:-1]).numel(), k), torch.randn(k, shape[-1])
    permuted = [shape[p] for p in perm]
    tensors = []
    for _, operand, _ in steps:
        if operand == "full":
            tensors.append(torch.randn(shape).permute(perm))
        elif operand == "full-contiguous":
            tensors.append(torch.randn(permuted))
        elif isinstance(operand, list):
            tensors.append(torch.randn(operand))
        else:
            tensors.append(None)
    return fn, (a, w, *tensors)


@settings(max_examples=30, deadline=None)
@given(chains())
def test_sinking_keeps_values_and_strides(chain):
    fn, inputs = build(*chain)
    inputs = tuple(t for t in inputs if t is not None)
    report = Report()
    ctx = PassContext(Config.from_env(providers=("aten",)), "inference", report)

    def traced():
        return make_fx(lambda *xs: fn(*xs[:2], *_fill(chain[2], xs[2:])), tracing_mode="fake")(*inputs)

    before, after = traced(), sink_permutes(traced(), ctx)
    want, got = before(*inputs), after(*inputs)
    assert same_strides(got, want)  # a dim of size 1 has no layout (legality.same_strides)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    steps = chain[2]
    # unary, scalar and vector steps all move; but a div of an operand by the value, which OPS writes as
    # operand / (|value| + 1): abs and reciprocal are no epilogue ops (a fresh Hypothesis example drew it)
    if all((op is None or not isinstance(op, str)) and not (name == "div" and first) for name, op, first in steps):
        out = next(n for n in after.graph.nodes if n.op == "output").args[0]
        mm = next(n for n in after.graph.nodes if n.target == torch.ops.aten.mm.default)
        assert out.target is PERMUTE and [n.target for n in _downstream(mm)].count(PERMUTE) == 1


def _downstream(node):
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return seen


def _fill(steps, tensors):
    it = iter(tensors)
    return [next(it) if operand is not None and not isinstance(operand, float) else None for _, operand, _ in steps]


def test_a_permute_of_something_else_stays():
    x, s = torch.randn(2, 3, 4), torch.randn(4, 1)
    gm, report = run(lambda x, s: torch.relu(x.permute(0, 2, 1) * s), x, s)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][0] is PERMUTE
    assert not any("permute" in r for r in report.rewrites)


class ConvNeXtBlock(nn.Module):
    """torchvision's CNBlock without the depthwise conv (and timm's dropout): NHWC linears, then layer scale and the
    shortcut in NCHW."""

    def __init__(self, c):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.layer_scale, self.drop = nn.Parameter(torch.randn(c, 1, 1)), nn.Dropout(0.1)  # eval: a clone (timm's)

    def forward(self, x):
        y = self.drop(self.down(nn.functional.gelu(self.up(self.norm(x.permute(0, 2, 3, 1)))))).permute(0, 3, 1, 2)
        return torch.relu(self.layer_scale * y + x)


def test_convnext_block_fuses_layer_scale_and_residual_through_the_triton_gemm():
    torch.manual_seed(0)
    block = ConvNeXtBlock(6).eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 6, 5, 3).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(block, interpret=True)
    double = copy.deepcopy(block).double()
    with torch.no_grad():
        out, ref = compiled(x), double(x.double())
    report = compiled.resfuse_report
    down = [f for f in report.fusions if f.anchor == "gemm" and f.ops != ["bias", "gelu"]]
    assert [f.ops for f in down] == [["bias", "mul", "add", "relu"]] and down[0].ran == "triton"
    assert out.stride() == ref.stride() and rel(out, ref) < 1e-5
    x3 = torch.randn(3, 6, 5, 3).to(memory_format=torch.channels_last)  # a new batch: recaptured with it dynamic
    with torch.no_grad():
        out, ref = compiled(x3), double(x3.double())
    down = [f for f in report.fusions if f.anchor == "gemm" and f.ops != ["bias", "gelu"]]
    assert [f.ops for f in down] == [["bias", "mul", "add", "relu"]] * 2
    assert out.stride() == ref.stride() and rel(out, ref) < 1e-5


def test_contiguous_residual_is_not_added_in_another_layout():
    """An NCHW-contiguous shortcut seen from the GEMM's NHWC frame is strided: the add stays out, values hold."""
    torch.manual_seed(0)
    block, x = ConvNeXtBlock(6).eval(), torch.randn(2, 6, 5, 3)
    torch._dynamo.reset()
    compiled = resfuse.compile(block, interpret=True)
    with torch.no_grad():
        out = compiled(x)
        ref = block.double()(x.double())
    assert out.stride() == ref.stride() and rel(out, ref) < 1e-5
    down = [f for f in compiled.resfuse_report.fusions if f.anchor == "gemm" and f.ops != ["bias", "gelu"]]
    assert [f.ops for f in down] == [["bias", "mul"]]
    assert any("strides" in r.reason for r in compiled.resfuse_report.rejected)
