"""resfuse::conv2d_shortcut: a fused 1x1 conv whose residual operand is another fused 1x1 conv's output, as one op.

    conv2d_shortcut(y, w1, operands1, epilogue1, slot, x, w2, operands2, epilogue2, stride, provider) -> z
    r = conv2d(x, w2, operands2, epilogue2, stride)    z = conv2d(y, w1, operands1 with r at `slot`, epilogue1)

passes/shortcut_conv.py puts it into inference graphs in place of a downsampling bottleneck's two resfuse::conv2d
calls (its shortcut conv, and its last conv, which absorbed the residual add). On the GPU the tuner (op
"conv2d_shortcut") measures our kernel (kernels/shortcut.py: r stays in registers, never written) against the two
convs as each was tuned on its own (provider "separate"), and the faster runs. Elsewhere, and wherever the
kernel refuses the shapes, the two convs run as two ops. PATHS records "triton" or "separate".
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from . import fused, library
from .chain import ONE

UNPADDED = ([0, 0], [1, 1])  # the shortcut conv's padding and dilation


def call_of(y, w1, operands1, epilogue1, slot, x, w2, operands2, epilogue2, stride):
    """The tuner's description of one such pair: inputs (y, w1, x, w2), both epilogues' operands in one list,
    params (how many are the first's, the residual's slot in the first, the shortcut's stride), the two
    signatures joined by ";", and z as its output."""
    from ..tuning.choose import Call

    return Call("conv2d_shortcut", (y, w1, x, w2), [*operands1, *operands2], f"{epilogue1};{epilogue2}",
                (len(operands1), slot, list(stride)), _output(y, w1, epilogue1))


def _output(y, w1, epilogue1) -> fused.Output:
    return _cached_output(tuple(y.shape), y.stride(), y.dtype, y.device, tuple(w1.shape), w1.stride(), epilogue1)


@functools.lru_cache(maxsize=None)
def _cached_output(y_shape, y_strides, dtype, device, w1_shape, w1_strides, epilogue1) -> fused.Output:
    """The main conv's output, as conv2d(y, w1) lays it out; cached, as call_of runs on every call."""
    def meta(shape, strides):
        return torch.empty_strided(shape, strides, dtype=dtype, device="meta")
    out = fused.conv_output(meta(y_shape, y_strides), meta(w1_shape, w1_strides), epilogue1, *ONE)
    return fused.Output(out.shape, out.strides, out.dtype, device)


def parts(call):
    """(operands1, epilogue1, slot, operands2, epilogue2, stride) of a Call; operands1 without the residual."""
    n, slot, stride = call.params
    epilogue1, epilogue2 = call.signature.split(";")
    return call.operands[:n], epilogue1, slot, call.operands[n:], epilogue2, stride


def run_kernel(call, config, z: torch.Tensor | None = None) -> torch.Tensor:
    """Our kernel with `config` (None: its heuristic default), into z (allocated when None)."""
    from .. import kernels

    ops1, sig1, slot, ops2, sig2, stride = parts(call)
    y, w1, x, w2 = call.inputs
    return kernels.conv2d_shortcut(y, w1, ops1, sig1, slot, x, w2, ops2, sig2, stride,
                                   call.out.empty() if z is None else z, config)


def run_separate(call, provider: str = "triton") -> torch.Tensor:
    """The two fused convs as two ops, each as the tuner chose for it on its own."""
    ops1, sig1, slot, ops2, sig2, stride = parts(call)
    y, w1, x, w2 = call.inputs
    r = fused._conv2d(x, w2, ops2, sig2, stride, *UNPADDED, provider, None)
    return fused._conv2d(y, w1, [*ops1[:slot], r, *ops1[slot:]], sig1, *ONE, provider, None)


def reference(call) -> torch.Tensor:
    """The unfused ATen computation of both convs, in the call's dtypes (the tuner upcasts them)."""
    ops1, sig1, slot, ops2, sig2, stride = parts(call)
    y, w1, x, w2 = call.inputs
    r = fused.conv2d_reference(x, w2, ops2, sig2, stride, *UNPADDED,
                               fused.conv_output(x, w2, sig2, stride, *UNPADDED).empty())
    return fused.conv2d_reference(y, w1, [*ops1[:slot], r, *ops1[slot:]], sig1, *ONE, call.out.empty())


def conv2d_shortcut_impl(y: torch.Tensor, w1: torch.Tensor, operands1: Sequence[torch.Tensor], epilogue1: str,
                         slot: int, x: torch.Tensor, w2: torch.Tensor, operands2: Sequence[torch.Tensor],
                         epilogue2: str, stride: Sequence[int], provider: str) -> torch.Tensor:
    call = call_of(y, w1, list(operands1), epilogue1, slot, x, w2, list(operands2), epilogue2, list(stride))
    if fused._use_triton(y.device, provider):
        from ..tuning import choose

        choice = choose.settled(call)
        if choice is None:
            # first sight of these shapes: each conv is tuned on its own first, so that the pair is measured
            # against their winners, not tuned again inside its own measurement
            z = run_separate(call, provider)
            choose.choose(call)
            fused._record("conv2d_shortcut", call.signature, "separate")
            return z
        fused._record("conv2d_shortcut", call.signature, "triton" if choice.provider == "triton" else "separate")
        if choice.provider == "triton":
            return run_kernel(call, choice.config)
    return run_separate(call, provider)


conv2d_shortcut = library.Op("conv2d_shortcut", conv2d_shortcut_impl)


@conv2d_shortcut.register_fake
def _(y, w1, operands1, epilogue1, slot, x, w2, operands2, epilogue2, stride, provider):
    # not through call_of: its cached layout helper cannot hash a graph's symbolic batch
    return fused.conv_output(y, w1, epilogue1, *ONE).empty()
