"""The separate provider, for a chain of two fused 1x1 convs only (ops/chain.py, op "conv2d_chain"): the two
convs as two ops, each run as the tuner chose for it on its own (its triton, cudnn, epilogue or aten winner).
The chain kernel's peer, and what runs wherever the chain kernel loses."""
from __future__ import annotations

from ..tuning.select import Candidate


def refusal(call) -> str | None:
    return None if call.op == "conv2d_chain" else "runs a chain of two convs only"


def candidates(call, level: str) -> list[Candidate]:
    from ..ops import chain

    return [Candidate("separate", "separate", {}, lambda: chain.run_separate(call))]
