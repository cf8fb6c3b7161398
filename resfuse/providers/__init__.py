"""Providers: who can run a fused op, and their candidates for the tuner. One interface, one module each.

Entry point: `candidates(call, level) -> list[tuning.select.Candidate]`. Each provider module has
`refusal(call) -> str | None` (can it run this op at all?) and `candidates(call, level)`.
  triton  our templates x the configs of tuning/space.py (with an epilogue-free twin for stage 1);
  epilogue  cuDNN/cuBLAS, then the whole epilogue in one generated Triton kernel (torch.compile's way);
  cudnn   one cuDNN frontend graph: conv_fprop, then the epilogue as pointwise nodes (optional extra);
  aten    the unfused baseline: cuDNN/cuBLAS, then the epilogue as separate torch ops.
An op of two fused 1x1 convs (a chain, op "conv2d_chain"; a conv and its residual's conv, "conv2d_shortcut") has
two: triton (our kernel of the pair) and separate (the two convs as two ops, each as tuned on its own).
"""
from __future__ import annotations

from . import aten, cudnn, epilogue, separate, triton

PROVIDERS = {"triton": triton, "cudnn": cudnn, "epilogue": epilogue, "aten": aten, "separate": separate}


def candidates(call, level: str, allowed=tuple(PROVIDERS)) -> list:
    out = []
    for name in allowed:
        provider = PROVIDERS.get(name)
        if provider is not None and provider.refusal(call) is None:
            out += provider.candidates(call, level)
    return out
