"""Tuning a conv and its residual's conv (op conv2d_shortcut) under the interpreter, with injected timings: our
kernel's configs, the two-epilogue form and the sum form with both batch norms folded, against the two convs as
two ops; the sum form's dry run compiles from the shapes alone; the op's first call runs the two convs, later
calls what was chosen."""
import pytest
import torch
import torch.nn.functional as F

import resfuse  # noqa: F401  (registers the ops)
from resfuse import kernels
from resfuse.ops import PATHS, shortcut
from resfuse.providers import fold_bn, triton as triton_provider
from resfuse.tuning import choose as ch

MAIN, SHORT = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))", "bn[#1e-05](acc,c0,c1,c2,c3)"


@pytest.fixture(autouse=True)
def _interpret():
    kernels.set_options(interpret=True)


def _inputs(short=SHORT):
    def nhwc(*shape):
        return torch.randn(shape).half().contiguous(memory_format=torch.channels_last)

    def bn(c):
        return [torch.randn(c) * 0.1, torch.rand(c) + 0.5, torch.rand(c) + 0.5, torch.randn(c) * 0.1]
    y, x = nhwc(2, 16, 3, 5), nhwc(2, 32, 6, 10)
    w1, w2 = (torch.randn(32, 16, 1, 1) / 4).half(), (torch.randn(32, 32, 1, 1) / 6).half()
    return y, w1, bn(32), MAIN, 4, x, w2, bn(32), short, [2, 2]


def _reference(y, w1, bn1, sig1, slot, x, w2, bn2, sig2, stride):  # the batch-norm shortcut's
    def bn(t, m, v, g, b):
        m, v, g, b = (u.double()[:, None, None] for u in (m, v, g, b))
        return (t - m) / torch.sqrt(v + 1e-5) * g + b
    r = bn(F.conv2d(x.double(), w2.double(), stride=stride), *bn2)
    return torch.relu(bn(F.conv2d(y.double(), w1.double()), *bn1) + r)


def bench_favouring(provider, fold=None):
    """A bench that times the candidates of `provider` (the file its run is written in; triton: providers/triton.py)
    fastest, and of those the form `fold` asks for."""
    def bench(fn):
        fn()
        cfg = next((d for d in fn.__defaults__ or () if hasattr(d, "fold")), None)  # a candidate's lambda cfg=cfg
        wanted = provider in fn.__code__.co_filename and (fold is None or getattr(cfg, "fold", None) == fold)
        return 1.0 if wanted else 2.0
    return bench


@pytest.mark.parametrize("winner, fold", [("triton", True), ("triton", False), ("separate", None)])
def test_tune_measures_the_kernel_against_the_two_convs(winner, fold):
    """The sum form's configs where the op folds (batch norms on both), the two-epilogue form's where it does not (a
    relu after the shortcut's batch norm)."""
    lines = []
    call = shortcut.call_of(*_inputs(SHORT if fold in (True, None) else f"relu({SHORT})"))
    entry = ch.tune(call, bench=bench_favouring(winner, fold), level="fast", report=lines.append)
    assert entry.provider == winner and (fold is None or entry.config["fold"] == fold)
    assert {c.config["fold"] for c in triton_provider.candidates(call, "fast")} == {fold in (True, None)}
    assert "over separate" in lines[0]


def test_the_sum_forms_dry_run_reads_no_values():
    """Precompile dry-runs a sum-form candidate on scratch tensors: its triton_part launches the same kernel on
    unfolded weights, and makes no fold (whose overflow check would read garbage)."""
    call = shortcut.call_of(*_inputs())
    folded = [c for c in triton_provider.candidates(call, "fast") if c.config["fold"]]
    assert folded and all(c.triton_part is not None for c in folded)
    assert ch.triton_launches(folded) == [c.triton_part for c in folded]
    before = dict(fold_bn._FOLDS)
    folded[0].triton_part()
    assert fold_bn._FOLDS == before


def test_the_op_runs_the_two_convs_first_then_the_choice(tmp_path, monkeypatch):
    monkeypatch.setattr(ch, "_tunable", lambda device: True)
    monkeypatch.setattr(ch, "_bench", bench_favouring("triton", fold=True))
    monkeypatch.setattr(ch, "_CHOICES", {})
    ch.configure("fast", str(tmp_path), budget_s=600)
    args = _inputs()
    ref = _reference(*args)
    PATHS.clear()
    for path in ("separate", "triton"):
        z = torch.ops.resfuse.conv2d_shortcut(*args, "triton")
        assert PATHS[("conv2d_shortcut", f"{MAIN};{SHORT}", path)] == 1
        assert z.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(z.double(), ref, rtol=2e-2, atol=2e-2)
    # the first call tuned each conv on its own (two entries), then the pair against them (a third)
    assert sorted(k["op"] for k, _ in ch._cache().entries()) == ["conv2d", "conv2d", "conv2d_shortcut"]
