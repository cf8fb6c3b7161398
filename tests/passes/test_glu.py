"""Gated MLPs (SwiGLU, GeGLU, ReGLU): act(gate) * up becomes one GEMM over an interleaved weight whose epilogue pairs
the columns (passes/glu.py), written as two linears (Llama) or one split in halves (Phi-3), against float64 eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import resfuse

from .helpers import against_float64, rel

ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
        "sigmoid": torch.sigmoid}


class GatedMlp(nn.Module):
    """x + down(act(gate(x)) * up(x)), as two linears or as one whose output is chunked (`merged`); `act_second`:
    the activation on the second half; `up_first`: the mul's operands swapped."""

    def __init__(self, act, width, hidden, merged=False, act_second=False, up_first=False, bias=False):
        super().__init__()
        self.act, self.merged, self.act_second, self.up_first = ACTS[act], merged, act_second, up_first
        if merged:
            self.gate_up = nn.Linear(width, 2 * hidden, bias=bias)
        else:
            self.gate, self.up = nn.Linear(width, hidden, bias=bias), nn.Linear(width, hidden, bias=bias)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        if self.merged:
            g, u = self.gate_up(x).chunk(2, dim=-1)
            if self.act_second:
                g, u = u, g
        else:
            g, u = self.gate(x), self.up(x)
        h = u * self.act(g) if self.up_first else self.act(g) * u
        return x + self.down(h)


def glus(report):
    return [f for f in report.fusions if f.anchor == "gemm" and f.ops[-1] == "mul"]


@settings(max_examples=12, deadline=None)
@given(act=st.sampled_from(sorted(ACTS)), merged=st.booleans(), act_second=st.booleans(), up_first=st.booleans(),
       rows=st.integers(1, 21), width=st.sampled_from([8, 24]), hidden=st.integers(3, 41), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_gated_mlp_runs_as_one_gemm_with_a_paired_epilogue(act, merged, act_second, up_first, rows, width, hidden,
                                                             seed, dtype):
    torch.manual_seed(seed)
    mlp = GatedMlp(act, width, hidden, merged, act_second and merged, up_first).eval().to(dtype)
    x = torch.randn(2, rows, width, dtype=dtype)
    out, ref, report = against_float64(mlp, x, fuse_glu=True)
    assert report.errors == []
    (glu,) = glus(report)
    assert glu.ops == [{"gelu_tanh": "gelu"}.get(act, act), "mul"] and glu.ran == "triton"
    assert glu.shapes["inputs"][1] == (width, 2 * hidden) and glu.shapes["out"] == (2, rows, hidden)
    # the down projection takes the residual add
    assert any(f.ops == ["add"] and f.shapes["out"][-1] == width for f in report.fusions)
    assert rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_a_gate_with_a_bias_or_a_half_read_elsewhere_is_not_paired():
    torch.manual_seed(0)
    biased = GatedMlp("silu", 8, 12, bias=True).eval()  # addmm's bias would need pairing too
    out, ref, report = against_float64(biased, torch.randn(3, 8), fuse_glu=True)
    assert glus(report) == [] and rel(out, ref) < 1e-5

    class Leaky(GatedMlp):  # the up half is also returned: the product must be written out
        def forward(self, x):
            u = self.up(x)
            return self.down(F.silu(self.gate(x)) * u), u

    leaky = Leaky("silu", 8, 12).eval()
    x = torch.randn(3, 8)
    torch._dynamo.reset()
    compiled = resfuse.compile(leaky, interpret=True, fuse_glu=True)
    with torch.no_grad():
        (y, u), (y_ref, u_ref) = compiled(x), leaky.double()(x.double())
    report = compiled.resfuse_report
    assert glus(report) == [] and rel(y, y_ref) < 1e-5 and rel(u, u_ref) < 1e-5
    assert any("GLU not fused" in r.reason and "consumers" in r.reason for r in report.rejected)


@pytest.mark.parametrize("fuse_glu", [True, False, None])
def test_the_switch_and_training_leave_the_gemms_apart(fuse_glu):
    """Off by default (Config.fuse_glu: slower at the power limit on an H200); never in training."""
    torch.manual_seed(0)
    mlp = GatedMlp("silu", 8, 12)
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    compiled = resfuse.compile(mlp.eval(), interpret=True, **({} if fuse_glu is None else {"fuse_glu": fuse_glu}))
    with torch.no_grad():
        assert rel(compiled(x), mlp(x)) < 1e-5
    assert len(glus(compiled.resfuse_report)) == bool(fuse_glu)
    torch._dynamo.reset()
    trained = resfuse.compile(mlp.train(), interpret=True, fuse_glu=True)
    loss = trained(x).square().sum()
    loss.backward()
    assert glus(trained.resfuse_report) == []  # the backward reads both halves: inference only
    assert mlp.gate.weight.grad is not None


def test_a_dynamic_batch_keeps_one_paired_gemm_for_every_size():
    """Captured with a symbolic batch, the GLU's output shape is resolved from its input on each call; a symbolic
    sequence length too (dynamic=True) leaves it unfused, with the reason."""
    torch.manual_seed(1)
    mlp = GatedMlp("silu", 8, 12).eval()
    for dynamic in (None, True):
        torch._dynamo.reset()
        compiled = resfuse.compile(mlp, interpret=True, fuse_glu=True, dynamic=dynamic)
        with torch.no_grad():
            for batch, seq in ((3, 7), (5, 7), (2, 9)):
                x = torch.randn(batch, seq, 8)
                if dynamic is None:
                    torch._dynamo.mark_dynamic(x, 0)
                assert rel(compiled(x), mlp(x)) < 1e-5
        report = compiled.resfuse_report
        assert report.errors == []
        if dynamic is None:
            assert [f.ran for f in glus(report)] == ["triton"]
        else:
            assert glus(report) == [] and any("GLU not fused: dynamic shape" in r.reason for r in report.rejected)
