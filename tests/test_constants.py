"""Values an inference graph computes from parameters alone, hoisted out of it (capture/constants.py).

Hypothesis draws a model with such values (merged linears' concatenated weights and biases, a scaled weight, a
buffer the forward updates, a parameter-only value the forward returns) and a run of parameter changes between
calls (in place, a new Parameter, `.data` reassigned, load_state_dict). Each call must match eager; the report
must name what was hoisted, and nothing else; a returned value must never be the cached one.
"""
import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import resfuse
from resfuse.bench.models import Autocast
from resfuse.capture import backend

CHANGES = ("none", "in place", "new parameter", "data", "load_state_dict")


class Model(nn.Module):
    def __init__(self, d, heads, scaled, counter, returns_param):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(d, d) for _ in range(heads))  # q, k, v: merged, their cat hoisted
        self.scale = nn.Parameter(torch.randn(d, d))
        self.scaled, self.counter, self.returns_param = scaled, counter, returns_param
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        out = sum(h(x).relu() for h in self.heads)
        if self.scaled:  # a weight computed from a parameter, standardised as timm's StdConv does: hoisted
            w = self.scale * 0.5
            out = out + x @ ((w - w.mean(1, keepdim=True)) / (w.var(1, keepdim=True, unbiased=False) + 1e-5).sqrt()).t()
        if self.counter:  # a buffer the graph writes: what it computes from it stays in the graph
            self.count.add_(1)
            out = out * (self.count + self.scale[0])
        if self.returns_param:  # a graph output computed from parameters alone stays in the graph
            return out, self.scale * 2
        return out


def _change(model, how, seed):
    g = torch.Generator().manual_seed(seed)
    w = model.heads[0].weight
    if how == "in place":
        with torch.no_grad():
            w.mul_(-2)
    elif how == "new parameter":
        model.heads[-1].bias = nn.Parameter(torch.randn(model.heads[-1].bias.shape, generator=g))
    elif how == "data":  # a new buffer, the same object and version counter: seen by its address
        w.data = torch.randn(w.shape, generator=g)
    elif how == "load_state_dict":
        model.load_state_dict({k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()})


def _expected_hoisted(heads, scaled, counter) -> int:
    return (2 if heads > 1 else 0) + scaled  # the weights' and the biases' cat; the scaled weight


@settings(max_examples=10, deadline=None)
@given(d=st.integers(1, 7), heads=st.integers(1, 3), scaled=st.booleans(), counter=st.booleans(),
       returns_param=st.booleans(), changes=st.lists(st.sampled_from(CHANGES), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_hoisted_values_follow_every_parameter_change(d, heads, scaled, counter, returns_param, changes, seed):
    torch.manual_seed(seed)
    eager = Model(d, heads, scaled, counter, returns_param).eval()
    ours = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = resfuse.compile(ours)
    with torch.no_grad():
        for step, how in enumerate(["none", *changes]):
            _change(eager, how, seed + step)
            _change(ours, how, seed + step)
            x = torch.randn(3, d)
            out, ref = compiled(x), eager(x)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"call {step}, after {how}")
            if returns_param:
                out[1].fill_(float("nan"))  # the caller's own tensor: the next call must not see this
    hoisted = [r for r in compiled.resfuse_report.rewrites if "hoisted out of it" in r]
    n = _expected_hoisted(heads, scaled, counter)
    assert [r.split(": ")[1].split(" value")[0] for r in hoisted] == ([str(n)] if n else [])
    torch.testing.assert_close(ours.count, eager.count)


def test_a_model_made_under_inference_mode_is_hoisted_and_followed():
    """Its parameters are inference tensors, without version counters: the hoisted values are computed again on
    every call, so an in-place edit under inference_mode is followed too (it raised before)."""
    with torch.inference_mode():
        torch.manual_seed(0)
        eager = Model(5, 3, True, False, False).eval()
        ours = copy.deepcopy(eager)
        torch._dynamo.reset()
        compiled = resfuse.compile(ours)
        for how in ("none", "in place", "none"):
            for m in (eager, ours):
                if how == "in place":
                    m.heads[1].weight.mul_(-2)
                    m.scale.add_(1)
            x = torch.randn(3, 5)
            torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5, msg=how)
    assert any("3 value(s)" in r and "hoisted" in r for r in compiled.resfuse_report.rewrites)


def test_hoisted_graph_reads_the_values_as_inputs_and_no_longer_computes_them():
    """The rewritten graph has one more input per hoisted value and none of the ops that computed them."""
    seen = []
    real = backend.build

    def spy(gm, example_inputs, *args):
        seen.append((gm.graph, len(example_inputs)))
        return real(gm, example_inputs, *args)

    torch.manual_seed(0)
    model = Model(4, 3, True, False, False).eval()
    torch._dynamo.reset()
    backend.build = spy
    try:
        with torch.no_grad():
            resfuse.compile(model)(torch.randn(2, 4))
    finally:
        backend.build = real
    (graph, n_inputs), = seen
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    assert not any(t.startswith("aten.cat") or t.startswith("aten.mul") for t in targets)
    assert sum(p.startswith("hoisted_") for p in placeholders) == 3 and n_inputs == len(placeholders)


def test_values_keep_the_compiled_layout_and_their_addresses():
    """A value whose computation gives other strides than the graph was compiled for (Inductor asserts its inputs'
    strides) is laid out as compiled; after an update it is refreshed into the same tensor (a CUDA graph reads it
    at its address)."""
    import torch.fx as fx

    from resfuse.capture.constants import Constants

    w = torch.randn(3, 4)
    compute = fx.symbolic_trace(lambda w: (w.t() * 2,))  # eager keeps the transpose's strides, (1, 4)
    constants = Constants(compute, [1], [], [((4, 3), (3, 1))])
    (value,) = constants.values_for([None, w])
    assert value.stride() == (3, 1)
    torch.testing.assert_close(value, w.t() * 2)
    with torch.no_grad():
        w.add_(1)
    (again,) = constants.values_for([None, w])
    assert again is value and again.stride() == (3, 1)
    torch.testing.assert_close(again, w.t() * 2)


def test_a_failed_hoisting_leaves_the_graph_as_it_was(monkeypatch):
    """Hoisting is only an optimisation: if it fails part-way, the graph it was rewriting is restored, runs as it
    would without the switch, and the report says why."""
    from resfuse.capture import constants

    real = constants.hoist_constants

    def half_done(gm, *args):
        real(gm, *args)  # the graph rewritten, then a failure
        raise RuntimeError("boom")

    monkeypatch.setattr(backend, "hoist_constants", half_done)
    torch.manual_seed(0)
    model = Model(4, 3, True, False, False).eval()
    torch._dynamo.reset()
    compiled = resfuse.compile(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert any("not hoisted: RuntimeError: boom" in n for n in compiled.resfuse_report.notes)
    assert not any("hoisted out of it" in r for r in compiled.resfuse_report.rewrites)


def test_a_dynamic_batch_reads_the_same_hoisted_values():
    """A graph compiled with a symbolic batch: the parameter-only values have static shapes and are hoisted, and
    every batch size reads them."""
    torch.manual_seed(0)
    model = Model(6, 3, True, False, False).eval()
    torch._dynamo.reset()
    compiled = resfuse.compile(model, dynamic=True)
    with torch.no_grad():
        for batch in (2, 3, 5, 2):
            x = torch.randn(batch, 6)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5, msg=str(batch))
    assert [r.split(": ")[1].split(" value")[0] for r in compiled.resfuse_report.rewrites if "hoisted" in r] == ["3"]


@pytest.mark.parametrize("budget", [1, 250])
def test_values_past_the_budget_stay_in_the_graph(monkeypatch, budget):
    """On a GPU the hoisted values may keep a tenth of its memory (`budget_bytes`); past that, the rest stay in the
    graph, in graph order, with a note. Here the budget is forced: none of the 240 + 64 bytes, or part of them."""
    monkeypatch.setattr(backend, "budget_bytes", lambda example_inputs: budget)
    torch.manual_seed(0)
    eager = Model(4, 3, True, False, False).eval()
    ours = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = resfuse.compile(ours)
    with torch.no_grad():
        for how in ("none", "in place", "new parameter"):
            _change(eager, how, 7)
            _change(ours, how, 7)
            x = torch.randn(2, 4)
            torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5, msg=how)
    report = compiled.resfuse_report
    hoisted = [int(r.split(": ")[1].split(" value")[0]) for r in report.rewrites if "hoisted out of it" in r]
    left = [int(n.split(": ")[1].split(" of")[0]) for n in report.notes if "left in the graph" in n]
    assert sum(hoisted) + sum(left) == 3 and left and (sum(hoisted) > 0) == (budget > 1)


def test_training_graphs_keep_their_parameter_computations():
    """Hoisting is for inference: a training graph differentiates through the concatenation."""
    torch.manual_seed(0)
    model = Model(4, 3, True, False, False)
    torch._dynamo.reset()
    compiled = resfuse.compile(model)
    compiled(torch.randn(2, 4)).sum().backward()
    assert not any("hoisted" in r for r in compiled.resfuse_report.rewrites)
    assert all(p.grad is not None for p in model.heads.parameters())


def test_switch_off_keeps_them_in_the_graph():
    torch.manual_seed(0)
    model = Model(4, 3, True, False, False).eval()
    torch._dynamo.reset()
    compiled = resfuse.compile(model, hoist_constants=False)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert not any("hoisted" in r for r in compiled.resfuse_report.rewrites)


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_cuda_graph_replays_read_the_refreshed_values():
    """On CUDA the inference graph replays as a CUDA graph that reads the hoisted values at their addresses: an
    in-place change of a parameter refreshes them there, a replaced parameter re-captures."""
    torch.manual_seed(0)
    eager = Model(64, 3, True, False, False).eval().cuda().half()
    ours = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = resfuse.compile(ours, tuning="none")
    with torch.no_grad():
        for step, how in enumerate(["none", "none", "in place", "none", "new parameter", "load_state_dict"]):
            for m in (eager, ours):
                _change(m, how, step)
                m.cuda().half()
            x = torch.randn(5, 64, device="cuda", dtype=torch.half)
            out, ref = compiled(x), eager(x)
            assert ((out - ref).float().norm() / ref.float().norm()).item() < 5e-3, (step, how)
    assert any("3 value(s)" in r and "hoisted" in r for r in compiled.resfuse_report.rewrites)


def test_autocast_weight_casts_are_hoisted_and_follow_an_update():
    """Under autocast each linear's fp32 weight and bias is cast on every call; hoisted, they are cast once and
    again after an in-place update."""
    torch.manual_seed(0)
    eager = Autocast(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), torch.bfloat16, "cpu").eval()
    ours = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = resfuse.compile(ours)
    with torch.no_grad():
        for how in ("none", "in place", "none"):
            for m in (eager.model[0], ours.model[0]):
                if how == "in place":
                    m.weight.mul_(-3)
            x = torch.randn(4, 16)
            out, ref = compiled(x), eager(x)
            assert out.dtype == ref.dtype == torch.bfloat16
            # bf16's rounding: the fused epilogue rounds once where eager rounds after the GEMM and again after relu
            torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2, msg=how)
    hoisted = [r for r in compiled.resfuse_report.rewrites if "hoisted out of it" in r]
    assert len(hoisted) == 1 and "4 value(s)" in hoisted[0] and "_to_copy" in hoisted[0]


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_autocast_conv_weights_fold_once_and_again_after_an_update():
    """Autocast inference on CUDA: the hoisted fp16 weight casts feed the batch norms folded into them (cuDNN's
    provider, fold_bn), so an in-place update must refresh the cast, then the fold, before the graph replays."""
    from .test_api import Block

    torch.manual_seed(0)
    eager = Autocast(Block(16), torch.float16).eval().cuda().to(memory_format=torch.channels_last)
    ours = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = resfuse.compile(ours, tuning="fast", tuning_budget_s=60)
    with torch.no_grad():
        for step, how in enumerate(["none", "none", "in place", "none", "load_state_dict"]):
            if how == "in place":
                for m in (eager, ours):
                    m.model.c1.weight.mul_(-2)
                    m.model.b2.running_var.mul_(3)
            elif how == "load_state_dict":
                state = {k: v * 0.5 if v.is_floating_point() else v for k, v in eager.state_dict().items()}
                eager.load_state_dict(state)
                ours.load_state_dict(state)
            x = torch.randn(4, 16, 9, 7, device="cuda").to(memory_format=torch.channels_last)
            out, ref = compiled(x), eager(x)
            assert ((out - ref).float().norm() / ref.float().norm()).item() < 5e-3, (step, how)
    assert any("hoisted out of it" in r for r in compiled.resfuse_report.rewrites)
