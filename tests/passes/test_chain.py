"""The chain pass (passes/chain.py) and resfuse::conv2d_chain through whole compiles under the interpreter:
bottleneck blocks in fp16 channels_last match eager, each tail and head 1x1 pair becomes one chain op whose
first output still feeds the residual, and the pairs the kernel cannot take say why."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import resfuse
from resfuse.ops import PATHS

from .helpers import compare, half_calls, net, reasons, rel, unloadable


@settings(max_examples=6, deadline=None)
@given(blocks=st.integers(2, 3), mid=st.sampled_from([16, 32]), size=st.tuples(st.integers(2, 6), st.integers(2, 7)),
       batch=st.integers(1, 2))
def test_bottleneck_pairs_become_chains_and_match_eager(blocks, mid, size, batch):
    # a stage like ResNet's layer 1, then the first block of a strided stage, whose 1x1 head reads the last tail
    torch.manual_seed(blocks * 100 + mid)
    model = net((16, mid, blocks, 1), (mid * 4, mid, 1, 2))
    # without the shortcut pass, which would take each first block's tail (tests/passes/test_shortcut_conv.py)
    out, ref, report = compare(model, torch.randn(batch, 3, *size), shortcut_convs=False)
    assert rel(out, ref) < 5e-3
    chains = [f for f in report.fusions if f.anchor == "conv2d_chain"]
    # every tail of the first stage chains with the head after it (the next block's, or the strided stage's)
    assert len(chains) == blocks
    assert all(f.pattern == "conv2d_bn_add_relu_conv2d_bn_relu" for f in chains[1:])
    ran = {path for (op, _, path), n in PATHS.items() if op == "conv2d_chain" and n}
    assert ran == {"triton"}
    assert sum(n for (op, _, _), n in PATHS.items() if op == "conv2d_chain") == len(chains)


def test_a_chain_out_of_resources_runs_as_two_ops(monkeypatch, capsys):
    """A GPU may not fit the chain kernel's untuned config (at two stages ResNet-50's layer-2 pair takes 639,672
    bytes of shared memory, over an H100's 232,448: bench/chain_smem.py). Triton raises as the kernel loads, before
    anything runs: the pair then runs as its two convs, on every later call too, and says so once."""
    from resfuse.kernels import chain

    launches = []
    monkeypatch.setattr(chain.ChainPlan, "launch", unloadable(launches))
    report = half_calls(net((16, 16, 2, 1)), (1, 3, 4, 5), shortcut_convs=False)
    chains = [f for f in report.fusions if f.anchor == "conv2d_chain"]
    ran = {path for (op, _, path), n in PATHS.items() if op == "conv2d_chain" and n}
    assert chains and ran == {"separate"}
    assert capsys.readouterr().out.count("runs as two ops") == 1 and len(launches) == 1  # refused once, remembered


def test_switch_off_and_the_aten_provider_keep_two_convs():
    model = net((16, 16, 2, 1))
    x = torch.randn(1, 3, 4, 4)
    for config in ({"chain_convs": False}, {"providers": ("aten",)}):
        out, ref, report = compare(model, x, **config)
        assert rel(out, ref) < 5e-3
        assert not [f for f in report.fusions if f.anchor == "conv2d_chain"]


class LateOperand(nn.Module):
    """The head conv's epilogue multiplies by a tensor the graph computes after the tail conv."""

    def __init__(self):
        super().__init__()
        self.tail, self.head = nn.Conv2d(16, 32, 1), nn.Conv2d(32, 16, 1)

    def forward(self, x, gate):
        y = torch.relu(self.tail(x))
        return self.head(y) * torch.sigmoid(gate)


class WideChannels(nn.Module):
    def __init__(self):
        super().__init__()
        self.tail, self.head = nn.Conv2d(24, 32, 1), nn.Conv2d(32, 16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.tail(x)))


@pytest.mark.parametrize("model, inputs, reason", [
    (LateOperand(), [(1, 16, 3, 3), (1, 16, 3, 3)], "computed after the first conv"),
    (WideChannels(), [(1, 24, 3, 3)], "powers of two"),
])
def test_pairs_the_kernel_cannot_take_say_why(model, inputs, reason):
    model = model.eval().half().to(memory_format=torch.channels_last)
    xs = [torch.randn(s).half().contiguous(memory_format=torch.channels_last) for s in inputs]
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    with torch.no_grad():
        out = compiled(*xs)
        ref = model.double()(*[x.double() for x in xs])
    assert rel(out, ref) < 5e-3
    report = compiled.resfuse_report
    assert not [f for f in report.fusions if f.anchor == "conv2d_chain"]
    assert reason in reasons(report)


def test_dynamic_batch_keeps_the_chain():
    """A batch marked dynamic: one capture, its chains serve every batch size."""
    model = net((16, 16, 2, 1)).eval().half().to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True, shortcut_convs=False)
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 3, 4, 5).half().contiguous(memory_format=torch.channels_last)
            torch._dynamo.mark_dynamic(x, 0)
            ref = model.double()(x.double())
            model.half()
            assert rel(compiled(x), ref) < 5e-3
    report = compiled.resfuse_report
    assert len(report.graphs) == 1 and "static peak" in str(report)  # the report prints a symbolic batch's peak
    assert len([f for f in report.fusions if f.anchor == "conv2d_chain"]) == 1  # block 0's tail, block 1's head
