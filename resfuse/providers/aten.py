"""The aten provider: the unfused baseline (cuDNN conv or cuBLAS matmul, then the epilogue as torch ops)."""
from __future__ import annotations

import torch

from ..tuning.select import Candidate
from . import separate


def refusal(call) -> str | None:
    return separate.REFUSAL if call.op in separate.PAIRS else None


def run(call, out: torch.Tensor) -> torch.Tensor:
    from ..ops import fused

    if call.op == "conv2d":
        return fused.conv2d_reference(*call.inputs, call.operands, call.signature, *call.params, out, call.aux)
    if call.op == "conv2d_dgrad":
        from ..ops import training
        return training.conv2d_dgrad_reference(*call.inputs, call.operands, call.signature, list(out.shape),
                                               *call.params, out, call.stats)
    return fused.gemm_reference(*call.inputs, call.operands, call.signature, *call.params, out, call.aux)


def candidates(call, level: str) -> list[Candidate]:
    scratch, own = call.out.empty(), call.scratch()  # never the live outputs (OneFlow #9452)
    return [Candidate("aten", "aten", {}, lambda: run(own, scratch))]
