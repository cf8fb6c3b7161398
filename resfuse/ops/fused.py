"""The fused ops, as torch.library custom ops: resfuse::conv2d and resfuse::gemm, and their _aux twins.

The rewrite pass puts calls to these into the graph. Each takes its anchor's inputs, the epilogue's tensor
operands (in slot order), the epilogue signature (epilogue.py) and a provider name. They have fake
implementations, so a rewritten graph can be re-traced, exported and CUDA-graphed.

Paths, recorded in PATHS so that the report can say which one ran:
  "reference"  the unfused ATen computation followed by the epilogue tree in torch (CPU, and the fallback);
  "triton"     our Triton kernel (CUDA, or CPU under the interpreter when kernels.interpret is on);
  "epilogue"   cuDNN/cuBLAS, then the epilogue in one Triton kernel (chosen by the tuner);
  "aten"       the same ATen computation as "reference", chosen by the tuner because it measured faster.

resfuse::conv2d_aux and resfuse::gemm_aux take the same arguments for an epilogue with an aux node and return
(out, aux): aux holds the value under that node (the pre-activation a training graph saves for the
activation's backward), in the inputs' dtype, laid out like out.

The output is described (`Output`) before it is allocated: every path but "epilogue" allocates it, while
"epilogue" returns cuDNN's/cuBLAS's accumulator itself, written in place, when it already is the output's dtype,
shape and strides, so that two activation-sized buffers are never alive at once (providers/epilogue.py).
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

import torch

from .. import epilogue as epi
from . import library

PATHS: collections.Counter = collections.Counter()  # (op, signature, path) -> calls


def dense_strides(shape, memory_format=torch.contiguous_format) -> tuple[int, ...]:
    """torch.empty(shape, memory_format=...).stride() without allocating (ATen's formulas, zero sizes included)."""
    if memory_format == torch.channels_last:
        _, c, h, w = shape
        return (h * w * c, 1, w * c, c)
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return tuple(strides)


@dataclasses.dataclass(frozen=True)
class Output:
    """The tensor a fused op returns, described but not yet allocated (the tuner's Call carries it)."""
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, shape, dtype, device, memory_format=torch.contiguous_format) -> Output:
        return cls(tuple(shape), dense_strides(shape, memory_format), dtype, device)

    @classmethod
    def like(cls, t: torch.Tensor) -> Output:
        return cls(tuple(t.shape), t.stride(), t.dtype, t.device)

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.strides, dtype=self.dtype, device=self.device)

    def fits(self, t: torch.Tensor) -> bool:
        """Can `t` itself be returned as this output?"""
        return (t.dtype == self.dtype and t.shape == self.shape and t.stride() == self.strides
                and t.device == self.device)


def conv_out_format(x: torch.Tensor, w: torch.Tensor) -> torch.memory_format:
    """The layout our conv writes; the rewrite pass checks that it is the one ATen chose in the trace."""
    def cl(t):
        return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
    return torch.channels_last if cl(x) or cl(w) else torch.contiguous_format


def conv_output(x, w, epilogue: str, stride, padding, dilation) -> Output:
    return Output.of(conv_out_shape(x, w, stride, padding, dilation), epi.out_dtype(epi.parse(epilogue), x.dtype),
                     x.device, conv_out_format(x, w))


def conv_out_shape(x, w, stride, padding, dilation) -> list[int]:
    n, _, h, wd = x.shape
    k, _, r, s = w.shape
    oh = (h + 2 * padding[0] - dilation[0] * (r - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (s - 1) - 1) // stride[1] + 1
    return [n, k, oh, ow]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _finish(acc: torch.Tensor, out: torch.Tensor, operands, signature: str, channel_dim: int,
            aux: torch.Tensor | None = None) -> torch.Tensor:
    """Apply the epilogue to an ATen accumulator, in fp32 or wider, and write it into `out` (and the value under
    its aux node into `aux`, when given)."""
    tree = epi.parse(signature)
    acc3 = epi.rows3(acc.to(_compute_dtype(acc.dtype)), acc.shape, channel_dim)
    ops3 = epi.operand_views(tree, operands, out.shape, channel_dim)  # a GLU's acc has twice out's channels
    epi.rows3(out, out.shape, channel_dim).copy_(epi.reference(tree, acc3, ops3))
    if aux is not None:
        epi.rows3(aux, aux.shape, channel_dim).copy_(epi.reference(epi.aux_value(tree), acc3, ops3))
    return out


def call_of(op: str, inputs: tuple, operands, epilogue: str, params: tuple, aux=None):
    """The tuner's description of one fused conv2d or gemm call (params: the op's own arguments after the
    signature). The ops build it on every call, and the epilogue pass to tune an op at capture time."""
    from ..tuning.choose import Call

    if op == "conv2d":
        stride, padding, dilation = params
        out = conv_output(*inputs, epilogue, stride, padding, dilation)
        params = (list(stride), list(padding), list(dilation))
    else:
        out_shape = _gemm_out_shape(*inputs, params[0])
        out = Output.of(out_shape, epi.out_dtype(epi.parse(epilogue), inputs[0].dtype), inputs[0].device)
        params = (list(out_shape),)
    return Call(op, tuple(inputs), list(operands), epilogue, params, out, aux)


def _use_triton(device: torch.device, provider: str) -> bool:
    if provider != "triton":
        return False
    from .. import kernels
    return kernels.available(device)


def ours_first(call, choice, launch):
    """(our kernel's output, the choice) where the choice is our kernel (launch(config) runs it) and its config
    loads here; else (None, what to run instead): the choice itself, or cuDNN/cuBLAS + our epilogue kernel where
    the config is too large for this GPU, from now on (tuning.choose.out_of_resources)."""
    if choice.provider != "triton":
        return None, choice
    from .. import kernels
    from ..tuning.choose import out_of_resources

    try:
        return launch(choice.config), choice
    except kernels.OutOfResources as e:  # raised as the kernel loads, before anything runs
        return None, out_of_resources(call, e)


def _record(op: str, signature: str, path: str) -> None:
    PATHS[(op, signature, path)] += 1


def conv2d_impl(x: torch.Tensor, weight: torch.Tensor, operands: Sequence[torch.Tensor], epilogue: str,
           stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], provider: str) -> torch.Tensor:
    return _conv2d(x, weight, operands, epilogue, stride, padding, dilation, provider, None)


def conv2d_aux_impl(x: torch.Tensor, weight: torch.Tensor, operands: Sequence[torch.Tensor], epilogue: str,
                    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                    provider: str) -> tuple[torch.Tensor, torch.Tensor]:
    """conv2d whose epilogue has an aux node: also returns that node's value (in x's dtype, laid out like out)."""
    aux = aux_output(conv_output(x, weight, epilogue, stride, padding, dilation), x.dtype).empty()
    return _conv2d(x, weight, operands, epilogue, stride, padding, dilation, provider, aux), aux


def aux_output(out: Output, dtype: torch.dtype) -> Output:
    return dataclasses.replace(out, dtype=dtype)


def _conv2d(x, weight, operands, epilogue, stride, padding, dilation, provider, aux):
    if _use_triton(x.device, provider):
        from .. import kernels
        from ..tuning.choose import choose

        call = call_of("conv2d", (x, weight), operands, epilogue, (stride, padding, dilation), aux)
        out = call.out
        result, choice = ours_first(call, choose(call), lambda config: kernels.conv2d(
            x, weight, list(operands), epilogue, list(stride), list(padding), list(dilation), out.empty(), config, aux))
        _record("conv2d", epilogue, choice.provider)
        if result is not None:
            return result
        if choice.provider == "epilogue":
            from ..providers import epilogue as two_kernels
            return two_kernels.run(call)
        if choice.provider == "cudnn":
            from ..providers import cudnn
            return cudnn.run(call, out.empty(), choice.config)
    else:
        _record("conv2d", epilogue, "reference")
        out = conv_output(x, weight, epilogue, stride, padding, dilation)
    return conv2d_reference(x, weight, operands, epilogue, stride, padding, dilation, out.empty(), aux)


conv2d = library.Op("conv2d", conv2d_impl)
conv2d_aux = library.Op("conv2d_aux", conv2d_aux_impl)


def conv2d_reference(x, weight, operands, epilogue, stride, padding, dilation, out, aux=None):
    """The unfused ATen path (cuDNN conv, then the epilogue as torch ops): the CPU path and the aten provider."""
    acc = torch.ops.aten.convolution(x, weight, None, list(stride), list(padding), list(dilation), False, [0, 0],
                                     groups_of(x, weight))
    return _finish(acc, out, operands, epilogue, 1, aux)


def groups_of(x, weight) -> int:
    """A conv's groups, from its shapes: the weight is [K, C / groups, R, S] (depthwise: C / groups = 1)."""
    return x.shape[1] // weight.shape[1]


def operands_fit(epilogue: str, operands, out_shape, channel_dim: int) -> None:
    """Raise where an operand does not broadcast to the op's output, as the kernels' and the reference's views of it
    would at the first call. The fake implementations run this on the passes' fake values (passes/group.fake_call),
    so a pass that builds such a call fails while it runs, and the graph runs unfused with the reason in the report
    (capture/backend.py), instead of the user's model raising. Static shapes only: comparing symbolic ones would
    guard on them."""
    if all(isinstance(d, int) for d in (*out_shape, *(d for t in operands for d in t.shape))):
        epi.operand_views(epi.parse(epilogue), list(operands), list(out_shape), channel_dim)


@conv2d.register_fake
def _(x, weight, operands, epilogue, stride, padding, dilation, provider):
    out = conv_output(x, weight, epilogue, stride, padding, dilation)
    operands_fit(epilogue, operands, out.shape, 1)
    return out.empty()


@conv2d_aux.register_fake
def _(x, weight, operands, epilogue, stride, padding, dilation, provider):
    out = conv_output(x, weight, epilogue, stride, padding, dilation)
    operands_fit(epilogue, operands, out.shape, 1)
    return out.empty(), aux_output(out, x.dtype).empty()


def with_batch(shape: Sequence[int], leading) -> list:
    """A shape argument whose leading dim is -1 (dynamic in the graph: passes/legality.shape_param) with that
    dim filled in from the inputs."""
    return [leading, *shape[1:]] if shape[0] == -1 else list(shape)


def _gemm_out_shape(a: torch.Tensor, b: torch.Tensor, out_shape: Sequence[int]) -> list:
    if out_shape[0] != -1:
        return list(out_shape)
    rest = math.prod(out_shape[1:])  # the output has prod(a.shape[:-1]) rows of out_shape[-1] (a GLU's: N / 2)
    return with_batch(out_shape, math.prod(a.shape[:-1]) * out_shape[-1] // rest if rest else 0)


def gemm_impl(a: torch.Tensor, b: torch.Tensor, operands: Sequence[torch.Tensor], epilogue: str,
         out_shape: Sequence[int], provider: str) -> torch.Tensor:
    """[M, K] @ [K, N] or [B, M, K] @ [B, K, N], then the epilogue, into a contiguous tensor of out_shape.

    out_shape is the product's shape, or a view of it that keeps the last dim (the [M, N] -> [B, S, N] of a
    linear layer): the epilogue's operands then broadcast against out_shape.
    """
    return _gemm(a, b, operands, epilogue, out_shape, provider, None)


def gemm_aux_impl(a: torch.Tensor, b: torch.Tensor, operands: Sequence[torch.Tensor], epilogue: str,
                  out_shape: Sequence[int], provider: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gemm whose epilogue has an aux node: also returns that node's value (in a's dtype, shaped like out)."""
    aux = Output.of(_gemm_out_shape(a, b, out_shape), a.dtype, a.device).empty()
    return _gemm(a, b, operands, epilogue, out_shape, provider, aux), aux


def _gemm(a, b, operands, epilogue, out_shape, provider, aux):
    if _use_triton(a.device, provider):
        from .. import kernels
        from ..tuning.choose import choose

        call = call_of("gemm", (a, b), operands, epilogue, (out_shape,), aux)
        out, out_shape = call.out, call.params[0]
        result, choice = ours_first(call, choose(call), lambda config: kernels.gemm(
            a, b, list(operands), epilogue, out.empty(), config, aux))
        _record("gemm", epilogue, choice.provider)
        if result is not None:
            return result
        if choice.provider == "epilogue":
            from ..providers import epilogue as two_kernels
            return two_kernels.run(call)
        if choice.provider == "cudnn":
            from ..providers import cudnn
            return cudnn.run(call, out.empty(), choice.config)
    else:
        _record("gemm", epilogue, "reference")
        out_shape = _gemm_out_shape(a, b, out_shape)
        out = Output.of(out_shape, epi.out_dtype(epi.parse(epilogue), a.dtype), a.device)
    return gemm_reference(a, b, operands, epilogue, out_shape, out.empty(), aux)


gemm = library.Op("gemm", gemm_impl)
gemm_aux = library.Op("gemm_aux", gemm_aux_impl)


def gemm_reference(a, b, operands, epilogue, out_shape, out, aux=None):
    """The unfused ATen path (cuBLAS, then the epilogue as torch ops). A bias alone on a 2-D product runs as
    addmm, as eager's linear layer does: cuBLAS adds the bias in its own epilogue, in one kernel, rounding once."""
    if _addmm_bias(a, b, operands, epilogue, out) and aux is None:
        torch.addmm(operands[0], a, b, out=out.view(a.shape[0], b.shape[1]))
        return out
    acc = torch.matmul(a, b).view([*out_shape[:-1], b.shape[-1]])  # a GLU's has twice out's columns
    return _finish(acc, out, operands, epilogue, -1, aux)


def _addmm_bias(a, b, operands, epilogue, out) -> bool:
    """Is this addmm(bias, a, b) into `out` viewed as [M, N]: a 2-D product whose epilogue is a bias alone, of
    the product's dtype, one value per column?"""
    n = b.shape[-1]
    return (a.dim() == b.dim() == 2 and epi.parse(epilogue) == epi.LONE_BIAS and operands[0].shape == (n,)
            and operands[0].dtype == a.dtype == b.dtype == out.dtype and out.is_contiguous())


@gemm.register_fake
def _(a, b, operands, epilogue, out_shape, provider):
    shape = _gemm_out_shape(a, b, out_shape)
    operands_fit(epilogue, operands, shape, -1)
    return a.new_empty(shape, dtype=epi.out_dtype(epi.parse(epilogue), a.dtype))


@gemm_aux.register_fake
def _(a, b, operands, epilogue, out_shape, provider):
    shape = _gemm_out_shape(a, b, out_shape)
    operands_fit(epilogue, operands, shape, -1)
    return a.new_empty(shape, dtype=epi.out_dtype(epi.parse(epilogue), a.dtype)), a.new_empty(shape)
