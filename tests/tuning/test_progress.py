"""The tuning progress bar: per-op lines (shape, winner, speedup over aten), closed when a graph has run."""
import io

from rich.console import Console

from resfuse.tuning import choose as ch
from resfuse.tuning.progress import PROGRESS, TuningProgress

from .test_tune import bench_favouring, conv_call


def _console():
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=200), buf


def test_lines_print_and_the_bar_closes_when_the_graph_has_run():
    console, buf = _console()
    p = TuningProgress(console)
    p.expect(3)
    p.op_done()  # a cache hit: counted, no bar yet
    assert p.bar is None
    p.measuring()
    p.op_done("resfuse: tuned conv2d 2x8x4x4 relu(acc): triton 1.0 us, 2.00x over aten")
    p.op_done()  # a cache hit: no line
    assert p.bar is not None and p.done == 3
    p.graph_ran()
    assert p.bar is None and p.total == p.done == 0
    assert "2.00x over aten" in buf.getvalue()
    p.graph_ran()  # later runs find nothing to close


def test_a_warm_start_shows_no_bar():
    console, buf = _console()
    p = TuningProgress(console)
    p.expect(2)
    p.op_done()
    p.op_done()
    assert p.bar is None
    p.graph_ran()
    assert p.total == p.done == 0 and buf.getvalue() == ""


def test_choose_reports_the_tuned_winner_and_its_speedup(tmp_path, monkeypatch):
    console, buf = _console()
    monkeypatch.setattr(PROGRESS, "console", console)
    monkeypatch.setattr(ch, "_tunable", lambda device: True)
    monkeypatch.setattr(ch, "_bench", bench_favouring("triton"))
    monkeypatch.setattr(ch, "_CHOICES", {})
    ch.configure("fast", str(tmp_path), budget_s=600)
    PROGRESS.expect(1)
    assert ch.choose(conv_call()).provider == "triton"
    PROGRESS.graph_ran()
    out = buf.getvalue()
    assert "tuned conv2d 1x6x5x5" in out and "triton:" in out and "2.00x over aten" in out
    assert PROGRESS.total == 0 and PROGRESS.bar is None
