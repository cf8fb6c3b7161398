"""Two-stage selection of the fastest correct implementation of one fused op.

Entry point: `select(candidates, reference, bench=..., top_k=..., budget_s=..., clock=...)`. The benchmarker
and the clock are arguments, so tests drive the logic with fake timings (as Triton's autotuner does).

Stage 1 times each kernel config *without* its epilogue and keeps the `top_k` fastest (TVM #9800). Stage 2
times that shortlist *with* the real epilogue, and its candidates' variants (the same mainloop, its output
written another way), beside every candidate that has no epilogue-free form (cuDNN's fused graph, the unfused
ATen baseline), checks each one's output against the reference, and keeps the fastest correct one: a config
chosen on its epilogue-free time can lose once fused (PyTorch #186059). The output checked is a second run's,
over the first run's outputs poisoned with NaN, so a candidate that leaves some of its output unwritten cannot
pass on what its scratch buffer held before: for a conv on a 1x1 image (EfficientNet-B0's squeeze-excitation,
32x480 > 20 channels) every cuDNN engine config but one wrote nothing, and one of them had been chosen. A candidate
that fails to build or launch, gives a wrong or non-finite answer, or reports an impossible time is
discarded, never chosen. Candidates run on scratch buffers of their own: never in place on live data
(OneFlow #9452).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Candidate:
    provider: str  # "triton" | "epilogue" | "cudnn" | "aten"
    name: str
    config: dict
    run: Callable[[], torch.Tensor]  # the fused op on scratch buffers, returns its output (a tuple: its outputs)
    mainloop: Callable[[], object] | None = None  # the same config without the epilogue (stage 1), if any
    variants: tuple["Candidate", ...] = ()  # stage 2 only, if this one is shortlisted: its mainloop is this one's
    # a non-triton provider's Triton kernel alone, to compile it; for a triton candidate whose run reads values
    # (the folds of ops/shortcut.py's sum form), the same launches from the shapes alone
    triton_part: Callable[[], object] | None = None


@dataclasses.dataclass
class Outcome:
    winner: Candidate | None
    times: dict  # name -> seconds, for every candidate timed in stage 2
    discarded: dict  # name -> why


def _timed(bench, fn) -> tuple[float | None, str | None]:
    try:
        t = bench(fn)
    except Exception as e:  # a failed build or launch only disqualifies this candidate; the reason is kept
        return None, f"{type(e).__name__}: {e}"
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        return None, f"impossible time {t!r}"
    return float(t), None


def _wrong(out, reference, tol: float) -> str | None:
    if isinstance(reference, tuple):  # an op of several outputs (a chain's y and z): each is checked
        if not isinstance(out, tuple) or len(out) != len(reference):
            return f"{type(out).__name__} output where {len(reference)} outputs were expected"
        return next((f"output {i}: {why}" for i, (o, r) in enumerate(zip(out, reference))
                     if (why := _wrong(o, r, tol))), None)
    if not isinstance(out, torch.Tensor) or out.shape != reference.shape:
        return f"output shape {getattr(out, 'shape', None)} != {tuple(reference.shape)}"
    out64, ref64 = out.double(), reference.double()
    if not torch.isfinite(out64).eq(torch.isfinite(ref64)).all():
        return "non-finite values where the reference has none"
    # The error any answer has once stored in the output dtype: large where values are fp16 subnormals, as a
    # small gradient's are (every candidate, eager's ATen ops included, missed a dgrad by 5.9e-3 that way).
    rounding = _relerr(reference.to(out.dtype).double(), ref64)
    err, allowed = _relerr(out64, ref64), tol + 2 * rounding
    return None if err <= allowed else f"relative error {err:.2e} > {allowed:.1e}"


def check(c: Candidate, reference, tol: float) -> str | None:
    """Why c's answer is wrong, or None: its output on a run over its previous outputs poisoned with NaN, against
    the reference. A candidate that raises is wrong too (this candidate is out, the reason is recorded)."""
    try:
        return _wrong(_poisoned_run(c), reference, tol)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _poisoned_run(c: Candidate):
    """c's outputs from a run over its previous run's outputs filled with NaN (its scratch buffers are reused)."""
    first = c.run()
    for t in first if isinstance(first, tuple) else (first,):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.fill_(float("nan"))
    return c.run()


def _relerr(x64: torch.Tensor, ref64: torch.Tensor) -> float:
    return ((x64 - ref64).nan_to_num().norm() / ref64.nan_to_num().norm().clamp_min(1e-30)).item()


def select(candidates: list[Candidate], reference: torch.Tensor | tuple, *, bench: Callable[[Callable], float],
           tol: float, top_k: int = 4, budget_s: float = math.inf,
           clock: Callable[[], float] = time.monotonic) -> Outcome:
    start, discarded = clock(), {}

    def over_budget() -> bool:
        return clock() - start > budget_s

    stage1 = []
    for c in candidates:
        if c.mainloop is None:
            continue
        if over_budget():
            discarded[c.name] = "tuning budget spent"
            continue
        t, why = _timed(bench, c.mainloop)
        if why:
            discarded[c.name] = f"stage 1: {why}"
        else:
            stage1.append((t, c))
    shortlist = [c for _, c in sorted(stage1, key=lambda tc: tc[0])[:top_k]]
    shortlist += [v for c in shortlist for v in c.variants]
    shortlist += [c for c in candidates if c.mainloop is None]

    times, best = {}, None
    for c in shortlist:
        if over_budget() and best is not None:
            discarded[c.name] = "tuning budget spent"
            continue
        why = check(c, reference, tol)
        t = None
        if not why:
            t, why = _timed(bench, c.run)
        if why:
            discarded[c.name] = f"stage 2: {why}"
            continue
        times[c.name] = t
        if best is None or t < times[best.name]:
            best = c
    return Outcome(best, times, discarded)
