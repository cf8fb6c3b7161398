"""Two-stage selection driven by injected timings (no GPU, no real kernels)."""
import itertools
import math

import torch

from resfuse.tuning.select import Candidate, select

REF = torch.randn(8, 8)


def cand(name, provider="triton", out=REF, stage1=True):
    run = lambda: out.clone()  # noqa: E731
    return Candidate(provider, name, {"name": name}, run, (lambda: None) if stage1 else None)


def fake_bench(times: dict):
    """bench(fn) -> the time registered for fn (keyed by the function object)."""
    def bench(fn):
        t = times[fn]
        if isinstance(t, Exception):
            raise t
        return t
    return bench


def test_stage2_time_with_epilogue_decides_not_stage1():
    a, b, c = cand("a"), cand("b"), cand("c")
    aten = cand("aten", "aten", stage1=False)
    times = {a.mainloop: 1.0, b.mainloop: 2.0, c.mainloop: 9.0,  # stage 1: a fastest without epilogue
             a.run: 5.0, b.run: 3.0, c.run: 0.5, aten.run: 4.0}  # with the epilogue, b wins; c never shortlisted
    out = select([a, b, c, aten], REF, bench=fake_bench(times), tol=1e-6, top_k=2)
    assert out.winner is b and set(out.times) == {"a", "b", "aten"}


def test_variants_are_timed_in_stage2_only_beside_a_shortlisted_candidate():
    """A variant (the same mainloop, its output written another way) has no stage-1 time of its own: it is timed
    in stage 2 when its candidate is shortlisted, and may win there; a cut candidate's variant is never run."""
    va, vc = cand("a+bulk", stage1=False), cand("c+bulk", stage1=False)
    a = Candidate("triton", "a", {}, lambda: REF.clone(), lambda: None, variants=(va,))
    c = Candidate("triton", "c", {}, lambda: REF.clone(), lambda: None, variants=(vc,))
    b = cand("b")
    times = {a.mainloop: 1.0, b.mainloop: 2.0, c.mainloop: 9.0, a.run: 5.0, b.run: 4.0, va.run: 3.0,
             vc.run: ValueError("a variant of a cut candidate ran")}
    out = select([a, b, c], REF, bench=fake_bench(times), tol=1e-6, top_k=2)
    assert out.winner is va and set(out.times) == {"a", "b", "a+bulk"}
    times[va.run] = 6.0
    out = select([a, b, c], REF, bench=fake_bench(times), tol=1e-6, top_k=2)
    assert out.winner is b and out.times["a+bulk"] == 6.0


def test_unfused_baseline_wins_when_it_is_fastest():
    a, aten = cand("a"), cand("aten", "aten", stage1=False)
    out = select([a, aten], REF, bench=fake_bench({a.mainloop: 1.0, a.run: 2.0, aten.run: 1.5}), tol=1e-6)
    assert out.winner is aten


def test_failures_wrong_answers_and_impossible_times_are_never_chosen():
    crash = cand("crash")
    wrong = cand("wrong", out=REF + 1)
    nan = cand("nan", out=torch.full_like(REF, math.nan))
    zero, inf, ok = cand("zero"), cand("inf"), cand("ok")
    times = {crash.mainloop: RuntimeError("launch failed"), wrong.mainloop: 0.1, nan.mainloop: 0.1,
             zero.mainloop: 0.1, inf.mainloop: 0.1, ok.mainloop: 0.5,
             wrong.run: 0.01, nan.run: 0.01, zero.run: 0.0, inf.run: math.inf, ok.run: 1.0}
    out = select([crash, wrong, nan, zero, inf, ok], REF, bench=fake_bench(times), tol=1e-6, top_k=10)
    assert out.winner is ok
    assert "launch failed" in out.discarded["crash"] and "relative error" in out.discarded["wrong"]
    assert "non-finite" in out.discarded["nan"] and "impossible" in out.discarded["zero"]
    assert "impossible" in out.discarded["inf"]


def test_budget_stops_stage1_but_keeps_a_winner():
    cands = [cand(f"c{i}") for i in range(5)]
    times = {c.mainloop: 1.0 + i for i, c in enumerate(cands)} | {c.run: 1.0 for c in cands}
    ticks = itertools.count()
    out = select(cands, REF, bench=fake_bench(times), tol=1e-6, budget_s=1.5, clock=lambda: next(ticks))
    assert out.winner is not None
    assert sum("budget" in why for why in out.discarded.values()) >= 2


def test_tolerance_allows_for_rounding_into_the_output_dtype():
    """fp16 gradients are often subnormal, where storing them costs far more than the dtype's usual
    tolerance: the correctly rounded answer (and one that is a unit off in the last place) must still pass,
    a 3% error must not."""
    torch.manual_seed(0)
    ref = torch.randn(64, 64) * 3e-6  # fp16 subnormals: spacing 6e-8
    rounded = ref.half()
    ulp_off = torch.where(torch.rand(64, 64) < 0.3, (rounded.float() + 6e-8).half(), rounded)
    assert ((rounded.double() - ref.double()).norm() / ref.double().norm()).item() > 5e-3  # beyond the usual tol
    for good in (rounded, ulp_off):
        assert select([cand("c", out=good)], ref, bench=lambda fn: 1.0, tol=5e-3).winner is not None
    bad = cand("bad", out=(ref * 1.03).half())
    assert "relative error" in select([bad], ref, bench=lambda fn: 1.0, tol=5e-3).discarded["bad"]


def test_a_candidate_that_leaves_its_output_unwritten_is_discarded():
    """Its scratch buffer already holds the right answer (memory a reference freed, a previous run): only a run
    over poisoned outputs tells it from one that computes. cuDNN's engines for a conv on a 1x1 image wrote nothing."""
    stale, scratch = REF.clone(), torch.empty_like(REF)
    idle = Candidate("cudnn", "idle", {}, lambda: stale)
    writes = Candidate("cudnn", "writes", {}, lambda: scratch.copy_(REF))
    out = select([idle, writes], REF, bench=fake_bench({idle.run: 1.0, writes.run: 2.0}), tol=1e-6)
    assert out.winner is writes and "non-finite" in out.discarded["idle"]
