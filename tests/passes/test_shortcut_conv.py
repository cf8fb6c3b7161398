"""The shortcut pass (passes/shortcut_conv.py) and resfuse::conv2d_shortcut through whole compiles under the
interpreter: a downsampling bottleneck's shortcut conv is computed inside its last conv (stride 1 and 2), the
network matches eager, the chains take the other tails, and the pairs the kernel cannot take say why."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import resfuse
from resfuse.ops import PATHS

from .helpers import compare, half_calls, net, reasons, rel, unloadable


def _fusions(report, anchor):
    return [f for f in report.fusions if f.anchor == anchor]


@settings(max_examples=6, deadline=None)
@given(blocks=st.integers(2, 3), mid=st.sampled_from([16, 32]), size=st.tuples(st.integers(3, 6), st.integers(3, 7)),
       batch=st.integers(1, 2))
def test_downsampling_blocks_compute_their_shortcut_inside_the_last_conv(blocks, mid, size, batch):
    # a stage like ResNet's layer 1 (its first block's shortcut at stride 1), then a strided stage's first block
    # (at least 2x2 pixels out: at one pixel and batch 1 FuseAddToOutput gives the add to the shortcut conv)
    torch.manual_seed(blocks * 100 + mid)
    model = net((16, mid, blocks, 1), (mid * 4, mid, 1, 2))
    out, ref, report = compare(model, torch.randn(batch, 3, *size))
    assert rel(out, ref) < 5e-3
    shortcuts = _fusions(report, "conv2d_shortcut")
    assert len(shortcuts) == 2
    assert all(f.pattern == "conv2d_bn_conv2d_bn_add_relu" for f in shortcuts)
    assert len(_fusions(report, "conv2d_chain")) == blocks - 1  # every tail but the first block's
    assert {path for (op, _, path), n in PATHS.items() if op == "conv2d_shortcut" and n} == {"triton"}
    assert not [f for f in report.fusions if f.anchor == "conv2d" and f.pattern == "conv2d_bn"]  # no shortcut left


def test_switch_off_and_the_aten_provider_keep_two_convs():
    model = net((16, 16, 2, 1), (64, 16, 1, 2))
    x = torch.randn(1, 3, 6, 6)
    for config in ({"shortcut_convs": False}, {"providers": ("aten",)}):
        out, ref, report = compare(model, x, **config)
        assert rel(out, ref) < 5e-3
        assert not _fusions(report, "conv2d_shortcut")


class ReadTwice(nn.Module):
    """The shortcut's output is also returned: it must be written, so it stays a conv of its own."""

    def __init__(self):
        super().__init__()
        self.main, self.short = nn.Conv2d(16, 32, 1), nn.Conv2d(16, 32, 1, stride=2)

    def forward(self, y, x):
        r = self.short(x)
        return torch.relu(self.main(y) + r), r


class PaddedShortcut(nn.Module):
    def __init__(self):
        super().__init__()
        self.main, self.short = nn.Conv2d(16, 32, 1), nn.Conv2d(16, 32, 3, stride=2, padding=1)

    def forward(self, y, x):
        return torch.relu(self.main(y) + self.short(x))


class ThreeByThreeMain(nn.Module):
    def __init__(self):
        super().__init__()
        self.main, self.short = nn.Conv2d(16, 32, 3, padding=1), nn.Conv2d(16, 32, 1, stride=2)

    def forward(self, y, x):
        return torch.relu(self.main(y) + self.short(x))


@pytest.mark.parametrize("model, reason", [
    (ReadTwice(), "other readers"), (PaddedShortcut(), "padded"), (ThreeByThreeMain(), "not 1x1 stride 1"),
])
def test_pairs_the_kernel_cannot_take_say_why(model, reason):
    model = model.eval().half().to(memory_format=torch.channels_last)
    y, x = (torch.randn(s).half().contiguous(memory_format=torch.channels_last) for s in ((1, 16, 3, 3), (1, 16, 6, 6)))
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    with torch.no_grad():
        out = compiled(y, x)
        ref = model.double()(y.double(), x.double())
    for o, r in zip(out if isinstance(out, tuple) else [out], ref if isinstance(ref, tuple) else [ref]):
        assert rel(o, r) < 5e-3
    report = compiled.resfuse_report
    assert not _fusions(report, "conv2d_shortcut")
    assert reason in reasons(report)


def test_dynamic_batch_keeps_the_shortcut():
    """A batch marked dynamic: one capture, its shortcut op serves every batch size."""
    model = net((16, 16, 1, 2)).eval().half().to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 3, 6, 5).half().contiguous(memory_format=torch.channels_last)
            torch._dynamo.mark_dynamic(x, 0)
            ref = model.double()(x.double())
            model.half()
            assert rel(compiled(x), ref) < 5e-3
    report = compiled.resfuse_report
    assert len(report.graphs) == 1 and len(_fusions(report, "conv2d_shortcut")) == 1


def test_the_sum_form_folds_both_batch_norms_or_falls_back_to_two_epilogues():
    """A config with fold runs the op as one sum of convs, its batch norms folded into the weights; where a fold
    overflows fp16 (a weight of 60000 doubled, on an input channel of zeros), the two epilogues run instead."""
    from resfuse import kernels
    from resfuse.kernels.shortcut import ShortcutConfig
    from resfuse.ops import shortcut

    kernels.set_options(interpret=True)
    cl, main, short = torch.channels_last, "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))", "bn[#1e-05](acc,c0,c1,c2,c3)"
    y = torch.randn(2, 16, 3, 4).half().contiguous(memory_format=cl)
    x = torch.randn(2, 32, 6, 8).half().contiguous(memory_format=cl)
    x[:, 0] = 0
    w1, w2 = (torch.randn(48, 16, 1, 1) / 4).half(), (torch.randn(48, 32, 1, 1) / 6).half()

    def bn(c, weight=None):
        return [torch.randn(c) * 0.1, torch.rand(c) + 0.5, torch.rand(c) + 0.5 if weight is None else weight,
                torch.randn(c) * 0.1]

    def expect(bn1, bn2):
        def norm(t, m, v, g, b):
            return (t - m[:, None, None]) / torch.sqrt(v[:, None, None] + 1e-5) * g[:, None, None] + b[:, None, None]
        r = norm(F.conv2d(x.double(), w2.double(), stride=2), *(t.double() for t in bn2))
        return torch.relu(norm(F.conv2d(y.double(), w1.double()), *(t.double() for t in bn1)) + r)

    cfg = ShortcutConfig(32, 32, 32, 8, 4, 2, fold=True)
    bn1, bn2 = bn(48), bn(48)
    call = shortcut.call_of(y, w1, bn1, main, 4, x, w2, bn2, short, [2, 2])
    assert shortcut.summed(call) is not None
    assert rel(shortcut.run_kernel(call, cfg), expect(bn1, bn2)) < 2e-3

    big = w2.clone()
    big[:, 0] = 60000
    bn2 = [torch.zeros(48), torch.ones(48) - 1e-5, torch.full((48,), 2.0), torch.zeros(48)]
    call = shortcut.call_of(y, w1, bn1, main, 4, x, big, bn2, short, [2, 2])
    assert shortcut.summed(call) is None  # 120000 does not fit fp16
    z = shortcut.run_kernel(call, cfg)
    assert z.isfinite().all() and rel(z, expect(bn1, bn2)) < 2e-3


def test_the_sum_form_follows_in_place_parameter_updates():
    """The folded weights are refolded when a batch norm's parameters change in place (an optimizer step,
    load_state_dict): the same compiled model's next call matches eager with the new values."""
    torch.manual_seed(7)
    model = net((16, 16, 1, 2)).eval().half().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6).half().contiguous(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    block = model[1]

    def eager():  # on a copy: converting the model itself would give its parameters new storage
        return copy.deepcopy(model).double()(x.double())
    with torch.no_grad():
        first = compiled(x)
        assert rel(first, eager()) < 5e-3 and len(_fusions(compiled.resfuse_report, "conv2d_shortcut")) == 1
        block.bn3.weight.mul_(-2.0)  # the main path's batch norm
        block.down[1].running_var.mul_(3.0)  # the shortcut's
        block.down[1].bias.add_(1.0)
        moved = compiled(x)
        assert rel(moved, eager()) < 5e-3 and rel(moved, first) > 1e-2


def test_a_shortcut_kernel_out_of_resources_runs_as_two_ops(monkeypatch, capsys):
    """As the chain's (test_chain.py): an untuned config of the shortcut kernel that does not load on this GPU
    raises as it loads, before anything runs; the pair then runs as its two convs, on later calls too, said once."""
    from resfuse.kernels import shortcut

    launches = []
    monkeypatch.setattr(shortcut.ShortcutPlan, "launch", unloadable(launches))
    torch.manual_seed(3)
    report = half_calls(net((16, 16, 1, 1), (64, 16, 1, 2)), (1, 3, 6, 6), chain_convs=False)
    assert len(_fusions(report, "conv2d_shortcut")) == 2
    assert {path for (op, _, path), n in PATHS.items() if op == "conv2d_shortcut" and n} == {"separate"}
    # tried once a pair, then remembered; said once a reason (both pairs' configs read the same)
    assert capsys.readouterr().out.count("runs as two ops") == 1 and len(launches) == 2
