"""The epilogue provider: cuDNN conv / cuBLAS matmul, then the whole epilogue in one generated Triton kernel.

Two kernels instead of one, but each the fastest of its kind where our fused mainloop is not (the way
torch.compile fuses). Entry points: `refusal`, `candidates`, and `run` (used by ops/fused.py).
"""
from __future__ import annotations

import torch

from .. import kernels
from ..tuning.select import Candidate


def refusal(call) -> str | None:
    return None if kernels.available(call.out.device) else f"no Triton kernels on {call.out.device}"


def run(call, out: torch.Tensor) -> torch.Tensor:
    if call.op == "conv2d":
        stride, padding, dilation = call.params
        acc = torch.ops.aten.convolution(*call.inputs, None, stride, padding, dilation, False, [0, 0], 1)
        return kernels.epilogue(acc, call.operands, call.signature, out, 1)
    if call.op == "conv2d_dgrad":
        from ..ops.training import cudnn_dgrad

        acc = cudnn_dgrad(*call.inputs, out.shape, *call.params)
        return kernels.epilogue(acc, call.operands, call.signature, out, 1)
    (out_shape,) = call.params
    acc = torch.matmul(*call.inputs).view(list(out_shape))
    return kernels.epilogue(acc, call.operands, call.signature, out, -1)


def candidates(call, level: str) -> list[Candidate]:
    scratch = torch.empty_like(call.out)
    return [Candidate("epilogue", "aten+epilogue", {}, lambda: run(call, scratch))]
