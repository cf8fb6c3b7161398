"""The fused ops of training graphs: resfuse::batch_norm, resfuse::batch_norm_stats and resfuse::conv2d_stats
(forward), resfuse::conv2d_dgrad, its _stats twin, resfuse::batch_norm_backward and its _dual twin (backward).

batch_norm is training-mode batch norm (batch statistics, running-stat update, the saved mean and invstd
that backward reads) with an epilogue on its output, e.g. relu(add(acc, full0)): the bn -> add -> relu tail
of a residual block, where the add is FuseAddToOutput's. It returns what aten._native_batch_norm_legit_functional
returns, with the epilogue applied to the first output.

batch_norm_stats is the same batch norm without its output: the statistics, the new running stats, and the fp32
per-channel scale and shift, stacked [2, C], that another batch norm's epilogue applies to x
(normalize(full0, c1, c2, c3) over x, save_mean, scale, shift), where passes/shortcut_bn.py folds a residual
block's shortcut batch norm in.

conv2d_stats is a conv2d that also returns fp32 [2, C] sums, sum(y) and sum(y * y) per channel, from cuDNN's
conv + genstats graph: passes/conv_stats.py hands them to the batch norm (or batch_norm_stats) that reads y, whose
kernel then skips its own statistics pass over y (its `sums` argument).

conv2d_dgrad is the data gradient of a conv2d with an epilogue, e.g. threshold_bwd(add(acc, full0), full1):
the skip-gradient add absorbed (FuseAddToOutput in backward), then relu's gradient. The weight gradient
stays with aten.convolution_backward (cuDNN), which the rewrite asks for the weight gradient alone.
conv2d_dgrad_stats takes the same arguments for an epilogue with a bn_stats root and returns (out, sums): sums is
fp32 [2, C], sum(out) and sum(out * (x - mean)) per channel, which the batch norm before the conv (in forward
order) needs for its backward; passes/bn_backward.py hands them to batch_norm_backward.

batch_norm_backward is aten.native_batch_norm_backward in training mode on our kernel (three deterministic
passes: kernels/batch_norm_bwd.py), put in backward graphs by passes/bn_backward.py. It always returns all
three gradients (the parameter gradients cost C values each); the graph reads the ones it asked for. Given
`sums`, its Triton path skips its own pass over grad_out and x for them. batch_norm_backward_dual is two of
them with one grad_out (a downsampling block's main and shortcut batch norms), in passes that read it once.

Paths are recorded in PATHS like the inference ops: "reference" (ATen, then the epilogue in torch) or
"triton" (our kernels, on CUDA or under the interpreter).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from .. import epilogue as epi
from . import library
from .fused import Output, _finish, _record, _use_triton, conv_out_format, ours_first, with_batch

aten = torch.ops.aten


def batch_norm_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               running_mean: torch.Tensor, running_var: torch.Tensor, operands: Sequence[torch.Tensor],
               epilogue: str, momentum: float, eps: float, provider: str,
               sums: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                               torch.Tensor]:
    if _use_triton(x.device, provider):
        from .. import kernels

        _record("batch_norm", epilogue, "triton")
        y, mean, invstd, rm, rv = kernels.batch_norm_train(x, weight, bias, running_mean, running_var,
                                                           list(operands), epilogue, momentum, eps, sums=sums)
        return (y, *_as_aten_dtypes(x, running_mean, (mean, invstd, rm, rv)))
    _record("batch_norm", epilogue, "reference")
    return batch_norm_reference(x, weight, bias, running_mean, running_var, operands, epilogue, momentum, eps)


batch_norm = library.Op("batch_norm", batch_norm_impl)


def _as_aten_dtypes(x, running_mean, stats) -> list:
    """The kernel's fp32 (save_mean, save_invstd, new running mean, new running var) in the dtypes ATen gives."""
    want = _aten_stat_dtypes(x.device.type, x.dtype, running_mean.dtype)
    return [t if t.dtype == d else t.to(d) for t, d in zip(stats, want)]


@functools.lru_cache(maxsize=None)
def _aten_stat_dtypes(device: str, x_dtype: torch.dtype, stat_dtype: torch.dtype) -> tuple:
    """The dtypes ATen (and so the fake implementation, and the traced graph) gives the statistics and the new
    running stats; they depend on the device. The kernel computes them in fp32."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3, 2, 2, dtype=x_dtype, device=device)
        p = torch.empty(3, dtype=stat_dtype, device=device)
        outs = aten._native_batch_norm_legit_functional(x, p, p, p, p, True, 0.1, 1e-5)
    return tuple(o.dtype for o in outs[1:])


def batch_norm_reference(x, weight, bias, running_mean, running_var, operands, epilogue, momentum, eps):
    out, mean, invstd, rm, rv = aten._native_batch_norm_legit_functional(x, weight, bias, running_mean,
                                                                          running_var, True, momentum, eps)
    y = _finish(out, torch.empty_like(out), operands, epilogue, 1)
    return y, mean, invstd, rm, rv


@batch_norm.register_fake
def _(x, weight, bias, running_mean, running_var, operands, epilogue, momentum, eps, provider, sums=None):
    # ATen's own metadata (the statistics' dtypes differ between devices and input dtypes)
    out, mean, invstd, rm, rv = aten._native_batch_norm_legit_functional(x, weight, bias, running_mean,
                                                                          running_var, True, momentum, eps)
    return torch.empty_like(out), mean, invstd, rm, rv


def batch_norm_stats_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                          running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float, eps: float,
                          provider: str, sums: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_triton(x.device, provider):
        from .. import kernels

        _record("batch_norm_stats", "", "triton")
        mean, invstd, rm, rv, scale_shift = kernels.batch_norm_stats(x, weight, bias, running_mean, running_var,
                                                                     momentum, eps, sums=sums)
        return (*_as_aten_dtypes(x, running_mean, (mean, invstd, rm, rv)), scale_shift)
    _record("batch_norm_stats", "", "reference")
    _, mean, invstd, rm, rv = aten._native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var,
                                                                        True, momentum, eps)
    return mean, invstd, rm, rv, torch.stack(_scale_shift(invstd, weight, bias))


batch_norm_stats = library.Op("batch_norm_stats", batch_norm_stats_impl)


def conv2d_stats_impl(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
                      dilation: Sequence[int], channels_last: bool, provider: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, sums): y = conv2d(x, weight) (groups 1, no bias), laid out channels_last or contiguous as asked, and
    sums fp32 [2, C], sum(y) and sum(y * y) per channel: what a training batch norm of y needs for its statistics.
    provider "cudnn": one cuDNN graph (conv_fprop + genstats), the sums from the conv's epilogue; "reference":
    ATen's conv, then the sums in fp32 over y as the batch norm reads it."""
    if provider == "cudnn" and x.is_cuda:
        from ..providers import cudnn_stats

        _record("conv2d_stats", "", "cudnn")
        y, sums = _conv_stats_outputs(x, weight, stride, padding, dilation, channels_last)
        cudnn_stats.conv_stats(x, weight, stride, padding, dilation, y, sums)
        return y, sums
    _record("conv2d_stats", "", "reference")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    y = aten.convolution(x, weight, None, stride, padding, dilation, False, [0, 0], 1).contiguous(memory_format=fmt)
    yf = y.float()
    return y, torch.stack([yf.sum((0, 2, 3)), (yf * yf).sum((0, 2, 3))])


conv2d_stats = library.Op("conv2d_stats", conv2d_stats_impl)


def _conv_stats_outputs(x, weight, stride, padding, dilation, channels_last) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (y, sums) as conv2d_stats returns them (its fake implementation too)."""
    size = [(n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, k, s, p, d in zip(x.shape[2:], weight.shape[2:], stride, padding, dilation)]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    y = torch.empty(x.shape[0], weight.shape[0], *size, dtype=x.dtype, device=x.device, memory_format=fmt)
    return y, torch.empty(2, weight.shape[0], dtype=torch.float32, device=x.device)


@conv2d_stats.register_fake
def _(x, weight, stride, padding, dilation, channels_last, provider):
    return _conv_stats_outputs(x, weight, stride, padding, dilation, channels_last)


def _scale_shift(invstd, weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (invstd * weight, bias), as kernels/batch_norm.py's statistics pass leaves them."""
    scale = invstd.float() * weight.float() if weight is not None else invstd.float().clone()
    shift = bias.float().clone() if bias is not None else torch.zeros_like(scale)
    return scale, shift


@batch_norm_stats.register_fake
def _(x, weight, bias, running_mean, running_var, momentum, eps, provider, sums=None):
    _, mean, invstd, rm, rv = aten._native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var,
                                                                        True, momentum, eps)
    return mean, invstd, rm, rv, torch.empty(2, x.shape[1], dtype=torch.float32, device=x.device)


def dgrad_out(grad_out: torch.Tensor, weight: torch.Tensor, input_shape) -> Output:
    return Output.of(with_batch(input_shape, grad_out.shape[0]), grad_out.dtype, grad_out.device,
                     conv_out_format(grad_out, weight))


def conv2d_dgrad_impl(grad_out: torch.Tensor, weight: torch.Tensor, operands: Sequence[torch.Tensor], epilogue: str,
                 input_shape: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                 dilation: Sequence[int], provider: str) -> torch.Tensor:
    return _dgrad(grad_out, weight, operands, epilogue, input_shape, stride, padding, dilation, provider, None)


def conv2d_dgrad_stats_impl(grad_out: torch.Tensor, weight: torch.Tensor, operands: Sequence[torch.Tensor],
                            epilogue: str, input_shape: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                            dilation: Sequence[int], provider: str) -> tuple[torch.Tensor, torch.Tensor]:
    sums = _sums(dgrad_out(grad_out, weight, input_shape))
    out = _dgrad(grad_out, weight, operands, epilogue, input_shape, stride, padding, dilation, provider, sums)
    return out, sums


def _sums(out: Output) -> torch.Tensor:
    return torch.empty(2, out.shape[1], dtype=torch.float32, device=out.device)


def _dgrad(grad_out, weight, operands, epilogue, input_shape, stride, padding, dilation, provider, sums):
    out = dgrad_out(grad_out, weight, input_shape)
    if _use_triton(grad_out.device, provider):
        from .. import kernels
        from ..tuning.choose import Call, choose

        call = Call("conv2d_dgrad", (grad_out, weight), list(operands), epilogue,
                    (list(stride), list(padding), list(dilation)), out, stats=sums)
        # the tuner weighs our kernel, cuDNN's dgrad + our epilogue kernel, and one cuDNN graph
        result, choice = ours_first(call, choose(call), lambda config: kernels.conv2d_dgrad(
            grad_out, weight, list(operands), epilogue, list(stride), list(padding), list(dilation), out.empty(),
            config, sums))
        _record("conv2d_dgrad", epilogue, choice.provider)
        if result is not None:
            return result
        if choice.provider == "epilogue":
            from ..providers import epilogue as two_kernels
            return two_kernels.run(call)
        if choice.provider == "cudnn":  # one cuDNN graph: conv_dgrad and the epilogue's pointwise ops
            from ..providers import cudnn
            return cudnn.run(call, out.empty(), choice.config)
    else:
        _record("conv2d_dgrad", epilogue, "reference")
    return conv2d_dgrad_reference(grad_out, weight, operands, epilogue, input_shape, stride, padding, dilation,
                                  out.empty(), sums)


conv2d_dgrad = library.Op("conv2d_dgrad", conv2d_dgrad_impl)
conv2d_dgrad_stats = library.Op("conv2d_dgrad_stats", conv2d_dgrad_stats_impl)


def conv2d_dgrad_reference(grad_out, weight, operands, epilogue, input_shape, stride, padding, dilation, out,
                           sums=None):
    """cuDNN's data gradient, then the epilogue in torch (and a bn_stats root's sums into `sums`, when given)."""
    _finish(cudnn_dgrad(grad_out, weight, out.shape, stride, padding, dilation), out, operands, epilogue, 1)
    if sums is not None:
        tree = epi.parse(epilogue)
        sums.copy_(epi.stats_reference(tree, epi.rows3(out, out.shape, 1),
                                       epi.operand_views(tree, operands, out.shape, 1)))
    return out


def cudnn_dgrad(grad_out, weight, input_shape, stride, padding, dilation) -> torch.Tensor:
    """ATen's (cuDNN's) data gradient alone, as the transposed convolution it is. Not convolution_backward
    with a stand-in input: ATen picks its layout from the input's strides and materialises it, so a
    one-element expand (torch.nn.grad.conv2d_input's trick) became an input-sized channels_last copy per call
    (14 ms of a ResNet-50 bs256 training step, and the op's extra 1.29 GB)."""
    output_padding = [i - ((o - 1) * st - 2 * p + d * (k - 1) + 1) for i, o, st, p, d, k in
                      zip(input_shape[2:], grad_out.shape[2:], stride, padding, dilation, weight.shape[2:])]
    groups = input_shape[1] // weight.shape[1]  # the weight is [K, C / groups, R, S], as a transposed conv wants
    return aten.convolution(grad_out, weight, None, list(stride), list(padding), list(dilation), True,
                            output_padding, groups)


@conv2d_dgrad.register_fake
def _(grad_out, weight, operands, epilogue, input_shape, stride, padding, dilation, provider):
    return dgrad_out(grad_out, weight, input_shape).empty()


@conv2d_dgrad_stats.register_fake
def _(grad_out, weight, operands, epilogue, input_shape, stride, padding, dilation, provider):
    out = dgrad_out(grad_out, weight, input_shape)
    return out.empty(), _sums(out)


def batch_norm_backward_impl(grad_out: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                             save_mean: torch.Tensor, save_invstd: torch.Tensor, eps: float, provider: str,
                             sums: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_triton(x.device, provider):
        from .. import kernels

        _record("batch_norm_backward", "sums" if sums is not None else "", "triton")
        return kernels.batch_norm_backward(grad_out, x, weight, save_mean, save_invstd, (True, True, True),
                                           _grad_input(grad_out, x), sums=sums)
    _record("batch_norm_backward", "", "reference")
    return _aten_bn_backward(grad_out, x, weight, save_mean, save_invstd, eps)


batch_norm_backward = library.Op("batch_norm_backward", batch_norm_backward_impl)


def batch_norm_backward_dual_impl(grad_out: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                                  save_mean: torch.Tensor, save_invstd: torch.Tensor, x2: torch.Tensor,
                                  weight2: Optional[torch.Tensor], save_mean2: torch.Tensor, save_invstd2: torch.Tensor,
                                  eps: float, eps2: float, provider: str) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor, torch.Tensor]:
    if _use_triton(x.device, provider):
        from .. import kernels

        _record("batch_norm_backward", "dual", "triton")
        return kernels.batch_norm_backward(grad_out, x, weight, save_mean, save_invstd, (True, True, True),
                                           _grad_input(grad_out, x),
                                           second=(x2, weight2, save_mean2, save_invstd2, _grad_input(grad_out, x2)))
    _record("batch_norm_backward", "dual", "reference")
    return (*_aten_bn_backward(grad_out, x, weight, save_mean, save_invstd, eps),
            *_aten_bn_backward(grad_out, x2, weight2, save_mean2, save_invstd2, eps2))


batch_norm_backward_dual = library.Op("batch_norm_backward_dual", batch_norm_backward_dual_impl)


def _aten_bn_backward(grad_out, x, weight, save_mean, save_invstd, eps):
    return aten.native_batch_norm_backward(grad_out, x, weight, None, None, save_mean, save_invstd, True, eps,
                                           [True, True, True])


def _grad_input(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """An empty grad_input for x at the strides ATen's batch-norm backward would give it."""
    strides = _grad_input_strides(tuple(grad_out.shape), grad_out.stride(), x.stride(), x.dtype, x.device)
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)


@functools.lru_cache(maxsize=None)
def _grad_input_strides(shape, g_strides, x_strides, x_dtype, device) -> tuple:
    """grad_input's strides as ATen gives them: its layout follows grad_out's and x's (e.g. channels_last from a
    channels_last grad_out). The parameter gradients' dtype (the weight's, else x's) the kernel matches itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        g = torch.empty_strided(shape, g_strides, dtype=x_dtype, device=device)
        x = torch.empty_strided(shape, x_strides, dtype=x_dtype, device=device)
        stat = torch.empty(shape[1], device=device)
        return _aten_bn_backward(g, x, None, stat, stat, 1e-5)[0].stride()


@batch_norm_backward.register_fake
def _(grad_out, x, weight, save_mean, save_invstd, eps, provider, sums=None):
    dx, dw, db = _aten_bn_backward(grad_out, x, weight, save_mean, save_invstd, eps)
    return torch.empty_like(dx), torch.empty_like(dw), torch.empty_like(db)


@batch_norm_backward_dual.register_fake
def _(grad_out, x, weight, save_mean, save_invstd, x2, weight2, save_mean2, save_invstd2, eps, eps2, provider):
    return (*(torch.empty_like(t) for t in _aten_bn_backward(grad_out, x, weight, save_mean, save_invstd, eps)),
            *(torch.empty_like(t) for t in _aten_bn_backward(grad_out, x2, weight2, save_mean2, save_invstd2, eps2)))
