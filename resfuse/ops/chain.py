"""resfuse::conv2d_chain: a fused 1x1 conv and the fused 1x1 conv that reads its output, as one op returning both.

    conv2d_chain(x, w1, operands1, epilogue1, w2, operands2, epilogue2, provider) -> (y, z)
    y = conv2d(x, w1, operands1, epilogue1)    z = conv2d(y, w2, operands2, epilogue2)    (1x1, stride 1)

passes/chain.py puts it into inference graphs, in place of the two resfuse::conv2d calls. On the GPU the tuner
(tuning/choose.py, op "conv2d_chain") measures our chain kernel (kernels/chain.py: y is stored, and multiplied
into z before it leaves the registers) against the two convs as each was tuned on its own (provider
"separate"), and the faster runs. Elsewhere, and wherever the chain kernel refuses the shapes, the two convs run
as two ops. PATHS records "triton" (the chain kernel) or "separate".
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from .. import epilogue as epi
from . import fused, library

ONE = ([1, 1], [0, 0], [1, 1])  # stride, padding, dilation of both convs


def signature_refusal(signature: str) -> str | None:
    """Why a fused conv with this epilogue cannot be one half of a chain (None: it can)."""
    tree = epi.parse(signature)
    if epi.aux_value(tree) is not None or epi.stats_node(tree) is not None:
        return "an epilogue with a second output"
    if epi.out_dtype(tree, torch.float16) != torch.float16:
        return "an epilogue that stores fp32"
    return None


def call_of(x, w1, operands1, epilogue1, w2, operands2, epilogue2):
    """The tuner's description of one chain: inputs (x, w1, w2), both epilogues' operands in one list (params
    says where the second's begin), the two signatures joined by ";", and z as its output (y: `y_output`)."""
    from ..tuning.choose import Call

    z = _second_output(fused.conv_output(x, w1, epilogue1, *ONE), tuple(w2.shape), w2.stride())
    return Call("conv2d_chain", (x, w1, w2), [*operands1, *operands2], f"{epilogue1};{epilogue2}",
                (len(operands1),), z)


@functools.lru_cache(maxsize=None)
def _second_output(y: fused.Output, w2_shape: tuple, w2_strides: tuple) -> fused.Output:
    """The second conv's output, as conv2d(y, w2) lays it out (the layout the separate path gives); cached, as
    call_of runs on every call."""
    def meta(shape, strides):
        return torch.empty_strided(shape, strides, dtype=y.dtype, device="meta")
    y_t, w2 = meta(y.shape, y.strides), meta(w2_shape, w2_strides)
    return fused.Output.of(fused.conv_out_shape(y_t, w2, *ONE), y.dtype, y.device, fused.conv_out_format(y_t, w2))


def parts(call):
    """(operands1, epilogue1, operands2, epilogue2) of a chain's Call."""
    n = call.params[0]
    epilogue1, epilogue2 = call.signature.split(";")
    return call.operands[:n], epilogue1, call.operands[n:], epilogue2


def y_output(call) -> fused.Output:
    x, w1, _ = call.inputs
    return fused.conv_output(x, w1, parts(call)[1], *ONE)


def run_chain(call, config, y: torch.Tensor | None = None, z: torch.Tensor | None = None):
    """Our chain kernel with `config` (None: its heuristic default), into y and z (allocated when None)."""
    from .. import kernels

    ops1, sig1, ops2, sig2 = parts(call)
    x, w1, w2 = call.inputs
    y = y_output(call).empty() if y is None else y
    z = call.out.empty() if z is None else z
    return kernels.conv2d_chain(x, w1, ops1, sig1, w2, ops2, sig2, y, z, config)


def run_separate(call, provider: str = "triton"):
    """The two fused convs as two ops, each as the tuner chose for it on its own."""
    ops1, sig1, ops2, sig2 = parts(call)
    x, w1, w2 = call.inputs
    y = fused._conv2d(x, w1, ops1, sig1, *ONE, provider, None)
    return y, fused._conv2d(y, w2, ops2, sig2, *ONE, provider, None)


def reference(call):
    """The unfused ATen computation of both convs, in the call's dtypes (the tuner upcasts them for its
    reference)."""
    ops1, sig1, ops2, sig2 = parts(call)
    x, w1, w2 = call.inputs
    y = fused.conv2d_reference(x, w1, ops1, sig1, *ONE, y_output(call).empty())
    return y, fused.conv2d_reference(y, w2, ops2, sig2, *ONE, call.out.empty())


def conv2d_chain_impl(x: torch.Tensor, w1: torch.Tensor, operands1: Sequence[torch.Tensor], epilogue1: str,
                      w2: torch.Tensor, operands2: Sequence[torch.Tensor], epilogue2: str,
                      provider: str) -> tuple[torch.Tensor, torch.Tensor]:
    call = call_of(x, w1, list(operands1), epilogue1, w2, list(operands2), epilogue2)
    return run_pair(call, provider, run_chain, run_separate)


def run_pair(call, provider: str, kernel, separate):
    """An op of two fused convs (this chain, ops/shortcut.py's pair): where our kernels run, on the first sight of
    its shapes `separate(call, provider)`, the two convs as two ops, which tunes each on its own, so that the pair
    is then measured against their winners, not tuned again inside its own measurement; later, what the tuner chose,
    `kernel(call, config)` or the two convs. PATHS records "triton" or "separate"."""
    if fused._use_triton(call.out.device, provider):
        from ..tuning import choose

        choice = choose.settled(call)
        if choice is None:
            out = separate(call, provider)
            choose.choose(call)
            fused._record(call.op, call.signature, "separate")
            return out
        if choice.provider == "triton":
            try:
                out = kernel(call, choice.config)
            except NotImplementedError as e:  # an untuned config the kernel found out of resources (tuning "none")
                if e.args[0] not in _SAID:
                    _SAID.add(e.args[0])
                    print(f"resfuse: {call.op} runs as two ops: {e.args[0]}")
            else:
                fused._record(call.op, call.signature, "triton")
                return out
        fused._record(call.op, call.signature, "separate")
    return separate(call, provider)


_SAID: set = set()  # the reasons run_pair printed, once each


conv2d_chain = library.Op("conv2d_chain", conv2d_chain_impl)


@conv2d_chain.register_fake
def _(x, w1, operands1, epilogue1, w2, operands2, epilogue2, provider):
    # not through call_of: its cached layout helper cannot hash a graph's symbolic batch
    y = fused.conv_output(x, w1, epilogue1, *ONE).empty()
    return y, fused.conv_output(y, w2, epilogue2, *ONE).empty()
