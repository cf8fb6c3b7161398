"""The pre-aot pass that merges linear layers reading one input into one GEMM (attention's q, k and v).

Hypothesis draws the group (how many linears, their widths, with or without bias) beside linears that must not
merge (another input, a computed weight); outputs and gradients are checked against eager's, and the report
and the graph against what should have merged. One test runs the merged GEMM's Triton kernel (interpreted)
forward and backward against a float64 reference.
"""
import copy

import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import resfuse
from resfuse.passes.merge_linears import LINEAR

from .helpers import rel


class Heads(nn.Module):
    """`widths` linears on x (the group), one on y and one whose weight is computed (neither may join it)."""

    def __init__(self, d, widths, bias):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(d, w, bias=bias) for w in widths)
        self.other, self.scaled = nn.Linear(d, 3), nn.Linear(d, 2)

    def forward(self, x, y):
        outs = [h(x) for h in self.heads]
        scaled = nn.functional.linear(x, self.scaled.weight * 2, self.scaled.bias)
        return torch.cat([o.relu() for o in outs] + [self.other(y), scaled], -1).sum(-1)


def _linears_seen(compiled, x, y):
    """How many linear calls each dynamo graph has once the pass has run (spied on the aot_autograd side)."""
    from resfuse.capture import backend

    counts, real = [], backend.aot_autograd

    def spy(**kw):
        lower = real(**kw)

        def run(gm, example_inputs):
            counts.append(sum(n.op == "call_function" and n.target in LINEAR for n in gm.graph.nodes))
            return lower(gm, example_inputs)
        return run

    backend.aot_autograd = spy
    try:
        out = compiled(x, y)
    finally:
        backend.aot_autograd = real
    return counts, out


@settings(max_examples=8, deadline=None)
@given(d=st.integers(1, 6), widths=st.lists(st.integers(1, 9), min_size=1, max_size=4), bias=st.booleans(),
       batch=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_linears_on_one_input_merge_and_keep_outputs_and_gradients(d, widths, bias, batch, seed):
    torch.manual_seed(seed)
    eager = Heads(d, widths, bias)
    ours = copy.deepcopy(eager)
    x, y = torch.randn(batch, 3, d), torch.randn(batch, 3, d)
    torch._dynamo.reset()
    compiled = resfuse.compile(ours)
    counts, out = _linears_seen(compiled, x, y)
    ref = eager(x, y)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    merged = [r for r in compiled.resfuse_report.rewrites if "merged into one GEMM" in r]
    if len(widths) >= 2:  # the group becomes one linear; `other` and `scaled` stay as they were
        assert counts == [3] and len(merged) == 1
        assert f"{len(widths)} linears on" in merged[0] and f"of {sum(widths)} outputs" in merged[0]
    else:  # a single linear on x, with `scaled` beside it: `scaled`'s weight is computed, so nothing merges
        assert counts == [3] and merged == []


def test_an_autocast_switch_between_the_linears_keeps_them_apart():
    class Switch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            first = self.a(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                second = self.b(x)
            return first + second.float()

    torch.manual_seed(0)
    model, x = Switch(), torch.randn(3, 4)
    torch._dynamo.reset()
    compiled = resfuse.compile(copy.deepcopy(model))
    torch.testing.assert_close(compiled(x), model(x), rtol=2e-2, atol=2e-2)  # the bf16 linear: one ulp apart
    assert any("not merged: a grad or autocast mode" in r for r in compiled.resfuse_report.rewrites)


def test_merged_gemm_runs_its_triton_kernel_forward_and_backward():
    """Under the interpreter the merged GEMM, its bias epilogue and the data gradient of the merged weight run
    our Triton kernels; the column slices feed the reshape attention applies next."""
    torch.manual_seed(3)
    model = Heads(8, [8, 8, 8], True).double()
    x, y = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    ref = model(x, y)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ours = copy.deepcopy(model).float()
    for p in ours.parameters():
        p.grad = None
    torch._dynamo.reset()
    compiled = resfuse.compile(ours, interpret=True)
    out = compiled(x.float(), y.float())
    out.square().sum().backward()
    assert rel(out, ref) < 1e-5
    for name, p in ours.named_parameters():
        assert rel(p.grad, ref_grads[name]) < 1e-4, name
    report = compiled.resfuse_report
    assert any("3 linears on" in r and "of 24 outputs" in r for r in report.rewrites)
    assert any(f.anchor == "gemm" and f.shapes["out"][-1] == 24 and f.ran == "triton" for f in report.fusions)
