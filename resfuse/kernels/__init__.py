"""Triton kernels for the fused ops; the CUDA (or interpreted CPU) path of resfuse::conv2d / resfuse::gemm.

Entry points, called by ops/fused.py:
  available(device)                                  can a kernel run on this device now?
  conv2d(x, w, operands, signature, stride, padding, dilation, out, config=None, aux=None) -> out
  conv2d_dgrad(grad_out, w, operands, signature, stride, padding, dilation, out, config=None, stats=None) -> out
                                                     grad_input of conv2d(input, w), with the epilogue
                                                     (stats: fp32 [2, C] sums of an epilogue's bn_stats root)
  gemm(a, b, operands, signature, out, config=None, aux=None) -> out
                                                     (aux: the second output of an epilogue with an aux node)
  conv2d_chain(x, w1, operands1, signature1, w2, operands2, signature2, y, z, config=None) -> (y, z)
                                                     two 1x1 convs, the second reading the first's output (chain.py)
  conv2d_shortcut(y, w1, operands1, signature1, slot, x, w2, operands2, signature2, stride, z, config=None) -> z
                                                     a 1x1 conv whose residual operand `slot` is another 1x1
                                                     conv's output, computed in the same kernel; with slot and
                                                     signature2 None, their sum (shortcut.py)
  epilogue(acc, operands, signature, out, channel_dim, aux=None, stats=None) -> out
                                                     the epilogue alone, on an ATen result
  batch_norm_train(...), batch_norm_stats(...),     training batch norm (batch_norm.py, batch_norm_bwd.py)
  batch_norm_backward(...)
  max_pool2d(...), max_pool2d_backward(...)          max pooling and its gradient (max_pool.py)
  max_pool2d_epilogue(...)                          max pooling of a monotone epilogue's value (max_pool.py)
  pad_channels(x, out) -> out                       x's channels zero-padded to out's, cast (padding.py)
  image_conv(x, w, stride, padding, out) -> out     a conv over an image of <= 4 channels (conv2d_image.py)
  OutOfResources                                    Triton's error for a config that does not load on this GPU
  set_options(interpret=..., cache_dir=..., split_k=..., pdl=..., prefetch=..., tma_store=..., compile_workers=...)
                                                    module state, made current for each compiled
                                                    model's calls (capture/backend.Settings)

Triton decides at decoration time whether a kernel is compiled or interpreted, so the interpreter switch is
process-wide and must be set before the first kernel is built.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

# A max-pool window code's flag (max_pool.py): the window's maximum is <= 0. Its taps are numbered below it.
WINDOW_NOT_POSITIVE = 64

# Triton's own switch (set by a test harness, or by set_options) tells the mode kernels get built in.
_OPTIONS = {"interpret": os.environ.get("TRITON_INTERPRET", "0") == "1", "cache_dir": None, "split_k": None,
            "pdl": True, "prefetch": True, "tma_store": True, "compile_workers": None}


def set_options(**options) -> None:
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"unknown kernel option(s): {sorted(unknown)}")
    if "interpret" in options:
        _set_interpret(bool(options["interpret"]))
    _OPTIONS.update(options)


def _set_interpret(on: bool) -> None:
    """Point Triton's decoration-time switch at `on`; refuse once kernels were built the other way."""
    built = sys.modules.get(__name__ + ".tiles")
    if built is not None and _OPTIONS["interpret"] != on:
        raise RuntimeError("resfuse kernels were already built with interpret="
                           f"{_OPTIONS['interpret']}; set kernels.set_options(interpret=...) before the first launch")
    # Set before triton is imported where possible: its own @jit helpers are decorated at that import.
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    if not triton_installed():
        return
    import triton
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older releases read TRITON_INTERPRET at decoration
    if knobs is not None:
        knobs.runtime.interpret = on


def __getattr__(name: str):
    if name == "OutOfResources":  # Triton's error for a config that does not load here; triton imported only now
        from triton.runtime.errors import OutOfResources  # (see _set_interpret)

        return OutOfResources
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def options() -> dict:
    return dict(_OPTIONS)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device: torch.device) -> bool:
    if not triton_installed():
        return False
    if device.type == "cuda":
        return not _OPTIONS["interpret"]
    return device.type == "cpu" and _OPTIONS["interpret"]


def conv2d(x, w, operands, signature, stride, padding, dilation, out, config=None, aux=None):
    from .launch import conv2d as run
    return run(x, w, operands, signature, stride, padding, dilation, out, config, aux)


def conv2d_dgrad(grad_out, w, operands, signature, stride, padding, dilation, out, config=None, stats=None):
    from .launch import conv2d_dgrad as run
    return run(grad_out, w, operands, signature, stride, padding, dilation, out, config, stats)


def conv2d_chain(x, w1, operands1, signature1, w2, operands2, signature2, y, z, config=None):
    from .chain import conv2d_chain as run
    return run(x, w1, operands1, signature1, w2, operands2, signature2, y, z, config)


def conv2d_shortcut(y, w1, operands1, signature1, slot, x, w2, operands2, signature2, stride, z, config=None):
    from .shortcut import conv2d_shortcut as run
    return run(y, w1, operands1, signature1, slot, x, w2, operands2, signature2, stride, z, config)


def epilogue(acc, operands, signature, out, channel_dim, aux=None, stats=None):
    from .elementwise import epilogue as run
    return run(acc, operands, signature, out, channel_dim, aux, stats)


def gemm(a, b, operands, signature, out, config=None, aux=None):
    from .launch import gemm as run
    return run(a, b, operands, signature, out, config, aux)


def batch_norm_train(x, weight, bias, running_mean, running_var, operands, signature, momentum, eps, out=None,
                     config=None, sums=None):
    """Training batch norm + epilogue -> (y, save_mean, save_invstd, new_running_mean, new_running_var). sums: fp32
    [2, C], sum(x) and sum(x * x) per channel where the conv producing x computed them (no statistics pass)."""
    from .batch_norm import batch_norm_train as run
    return run(x, weight, bias, running_mean, running_var, operands, signature, momentum, eps, out, config, sums)


def batch_norm_stats(x, weight, bias, running_mean, running_var, momentum, eps, config=None, sums=None):
    """Training batch norm's statistics alone -> (save_mean, save_invstd, new_running_mean, new_running_var,
    scale_shift), the last fp32 [2, C] (scale, shift): y would be (x - save_mean) * scale + shift. sums: as
    batch_norm_train's."""
    from .batch_norm import batch_norm_stats as run
    return run(x, weight, bias, running_mean, running_var, momentum, eps, config, sums)


def batch_norm_backward(grad_out, x, weight, save_mean, save_invstd, output_mask, grad_input=None, config=None,
                        sums=None, second=None):
    """Training batch-norm backward -> (grad_input, grad_weight, grad_bias), None where output_mask is False.
    `sums`: fp32 [2, C] sum(grad_out) and sum(grad_out * (x - save_mean)) when its producer computed them.
    `second`: (x, weight, save_mean, save_invstd, grad_input or None) of a second batch norm with the same grad_out;
    then six gradients, the second's last, from passes that read grad_out once."""
    from .batch_norm_bwd import Norm, batch_norm_backward as run
    return run(grad_out, x, weight, save_mean, save_invstd, output_mask, grad_input, config, sums,
               Norm(*second) if second is not None else None)


def max_pool2d(x, kernel, stride, padding, dilation, out, indices=None):
    """Max pooling -> (out, indices); indices are written only when given: int64 as ATen's, int8 or int16 as
    window codes (max_pool.py)."""
    from .max_pool import max_pool2d as run
    return run(x, kernel, stride, padding, dilation, out, indices)


def max_pool2d_epilogue(x, operands, signature, kernel, stride, padding, dilation, out):
    """out = max-pool of epilogue(x), for an epilogue monotone within each channel (epilogue.monotone_refusal)."""
    from .max_pool import max_pool2d_epilogue as run
    return run(x, operands, signature, kernel, stride, padding, dilation, out)


def max_pool2d_backward(grad_out, indices, kernel, stride, padding, dilation, grad_input, mask=None, threshold=0.0,
                        mask_is_input=False):
    """grad_input of max pooling, optionally through relu's gradient (mask <= threshold -> 0); with window codes
    and a mask that is the pool's input, the codes give relu's gradient."""
    from .max_pool import max_pool2d_backward as run
    return run(grad_out, indices, kernel, stride, padding, dilation, grad_input, mask, threshold, mask_is_input)


def image_conv(x, w, stride, padding, out):
    """out = conv2d(x, w, stride, padding) for an image of at most 4 channels (a stem), out dense channels_last."""
    from .conv2d_image import image_conv as run
    return run(x, w, stride, padding, out)


def pad_channels(x, out):
    """out[:, :C] = x (cast to out's dtype), out[:, C:] = 0, for a 4-D x of C channels."""
    from .padding import pad_channels as run
    return run(x, out)
