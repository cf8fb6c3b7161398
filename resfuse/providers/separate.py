"""The separate provider, for the ops of two fused convs only (PAIRS: ops/chain.py's chain of two 1x1 convs, op
"conv2d_chain"; ops/shortcut.py's conv and its residual's conv, op "conv2d_shortcut"): the two convs as two ops,
each run as the tuner chose for it on its own (its triton, cudnn, epilogue or aten winner). Our pair kernel's peer,
and what runs wherever that kernel loses."""
from __future__ import annotations

from ..tuning.select import Candidate

PAIRS = ("conv2d_chain", "conv2d_shortcut")
REFUSAL = "two convs in one op: the separate provider runs them as two ops"


def refusal(call) -> str | None:
    return None if call.op in PAIRS else "runs an op of two convs only"


def candidates(call, level: str) -> list[Candidate]:
    return [Candidate("separate", "separate", {}, lambda: pair_op(call).run_separate(call))]


def pair_op(call):
    """The ops module of a pair's Call: its run_separate, reference and run_kernel."""
    from ..ops import chain, shortcut

    return chain if call.op == "conv2d_chain" else shortcut
