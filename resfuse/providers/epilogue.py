"""The epilogue provider: cuDNN conv / cuBLAS matmul, then the whole epilogue in one generated Triton kernel.

Two kernels instead of one, but each the fastest of its kind where our fused mainloop is not (the way
torch.compile fuses). The epilogue kernel writes into the accumulator itself where it can, so the op's peak
memory is one output, not two. Entry points: `refusal`, `candidates`, and `run(call)` (used by the ops).
"""
from __future__ import annotations

import dataclasses

import torch

from .. import kernels
from ..tuning.select import Candidate


def refusal(call) -> str | None:
    from . import separate

    if call.op in separate.PAIRS:
        return separate.REFUSAL
    return None if kernels.available(call.out.device) else f"no Triton kernels on {call.out.device}"


def run(call) -> torch.Tensor:
    """The epilogue kernel on cuDNN's/cuBLAS's accumulator, in place when the accumulator already has the output's
    dtype, shape and strides (an fp16 conv in channels_last, an fp16 matmul): no second activation-sized buffer.
    In place is safe: each program reads its tile, then writes that same tile, and the accumulator is the fresh
    result of the ATen call here, never an operand or any other live tensor. Otherwise (an fp32 output under a
    float32 marker, another layout) the output is a new tensor."""
    return _epilogue(call, *_accumulator(call))


def kernel_only(call) -> torch.Tensor:
    """The epilogue kernel alone, as `run` launches it, on an uninitialised accumulator laid out as ATen's would
    be: what the tuner's compile workers are given (tuning/precompile.py) without running a conv. The layout comes
    from fake tensors on the inputs' device (on the "meta" device, ATen's conv layout rule for CUDA does not
    apply: a channels_last conv's accumulator came out contiguous)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        like, channel_dim = _accumulator(dataclasses.replace(call, inputs=tuple(map(mode.from_tensor, call.inputs))))
    return _epilogue(call, torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=call.out.device),
                     channel_dim)


def _epilogue(call, acc: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """The epilogue kernel on `acc`, into acc itself where it already is the output, else into a new output."""
    out = acc if call.out.fits(acc) else call.out.empty()
    return kernels.epilogue(acc, call.operands, call.signature, out, channel_dim, call.aux, call.stats)


def _accumulator(call) -> tuple[torch.Tensor, int]:
    if call.op == "conv2d":
        from ..ops.fused import groups_of

        stride, padding, dilation = call.params
        return torch.ops.aten.convolution(*call.inputs, None, stride, padding, dilation, False, [0, 0],
                                          groups_of(*call.inputs)), 1
    if call.op == "conv2d_dgrad":
        from ..ops.training import cudnn_dgrad

        return cudnn_dgrad(*call.inputs, call.out.shape, *call.params), 1
    (out_shape,) = call.params
    width = call.inputs[1].shape[-1]  # a GLU's product has twice the output's columns (epilogue.paired)
    return torch.matmul(*call.inputs).view([*out_shape[:-1], width]), -1


def candidates(call, level: str) -> list[Candidate]:
    # measured as the op runs it: each run writes into the accumulator it has just computed (or a new output),
    # its own scratch, never a live buffer (OneFlow #9452)
    own = call.scratch()
    return [Candidate("epilogue", "aten+epilogue", {}, lambda: run(own), triton_part=lambda: kernel_only(own))]
