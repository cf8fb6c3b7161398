"""Tuning a chain of two 1x1 convs (op conv2d_chain) under the interpreter, with injected timings: the chain
kernel's configs against the two convs as two ops, both checked on y and z; the op's first call runs the two
convs (tuning each on its own), later calls what was chosen."""
import pytest
import torch
import torch.nn.functional as F

import resfuse  # noqa: F401  (registers the ops)
from resfuse import kernels
from resfuse.ops import PATHS, chain
from resfuse.tuning import choose as ch

SIG1, SIG2 = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))", "relu(bn[#1e-05](acc,c0,c1,c2,c3))"


@pytest.fixture(autouse=True)
def _interpret():
    kernels.set_options(interpret=True)


def _inputs():
    h = torch.float16

    def nhwc(*shape):
        return torch.randn(shape).to(h).contiguous(memory_format=torch.channels_last)
    x, res = nhwc(2, 16, 3, 5), nhwc(2, 32, 3, 5)
    w1, w2 = (torch.randn(32, 16, 1, 1) / 4).to(h), (torch.randn(16, 32, 1, 1) / 6).to(h)
    bn1 = [torch.randn(32), torch.rand(32) + 0.5, torch.randn(32), torch.randn(32)]
    bn2 = [torch.randn(16), torch.rand(16) + 0.5, torch.randn(16), torch.randn(16)]
    return x, w1, [*bn1, res], SIG1, w2, bn2, SIG2


def _reference(x, w1, ops1, sig1, w2, ops2, sig2):
    def bn(t, m, v, g, b):
        m, v, g, b = (u.double()[:, None, None] for u in (m, v, g, b))
        return (t - m) / torch.sqrt(v + 1e-5) * g + b
    y = torch.relu(bn(F.conv2d(x.double(), w1.double()), *ops1[:4]) + ops1[4].double())
    return y, torch.relu(bn(F.conv2d(y, w2.double()), *ops2))


def bench_favouring(provider):
    def bench(fn):
        fn()
        return 1.0 if provider in fn.__code__.co_filename else 2.0
    return bench


@pytest.mark.parametrize("winner", ["triton", "separate"])
def test_tune_measures_the_chain_kernel_against_the_two_convs(winner):
    lines = []
    call = chain.call_of(*_inputs())
    entry = ch.tune(call, bench=bench_favouring(winner), level="fast", report=lines.append)
    assert entry.provider == winner
    assert "separate" in entry.times and any(k.startswith("triton:") for k in entry.times)
    assert "over separate" in lines[0]


def test_a_chain_kernel_that_writes_a_wrong_y_is_never_chosen(monkeypatch):
    real = chain.run_chain

    def wrong_y(call, config, y=None, z=None):
        y, z = real(call, config, y, z)
        y.mul_(2)  # z stays right: only checking both outputs catches it
        return y, z
    monkeypatch.setattr(chain, "run_chain", wrong_y)
    entry = ch.tune(chain.call_of(*_inputs()), bench=bench_favouring("triton"), level="fast", report=lambda s: None)
    assert entry.provider == "separate" and list(entry.times) == ["separate"]


def test_the_op_runs_the_two_convs_first_then_the_choice(tmp_path, monkeypatch):
    monkeypatch.setattr(ch, "_tunable", lambda device: True)
    monkeypatch.setattr(ch, "_bench", bench_favouring("triton"))
    monkeypatch.setattr(ch, "_CHOICES", {})
    ch.configure("fast", str(tmp_path), budget_s=600)
    args = _inputs()
    y_ref, z_ref = _reference(*args)
    PATHS.clear()
    for path in ("separate", "triton"):
        y, z = torch.ops.resfuse.conv2d_chain(*args, "triton")
        assert PATHS[("conv2d_chain", f"{SIG1};{SIG2}", path)] == 1
        for out, ref in ((y, y_ref), (z, z_ref)):
            assert out.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    # the first call tuned each conv on its own (two entries), then the chain against them (a third)
    assert sorted(k["op"] for k, _ in ch._cache().entries()) == ["conv2d", "conv2d", "conv2d_chain"]
