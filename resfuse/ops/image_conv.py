"""resfuse::image_conv(x, w, stride, padding, dtype, provider): a bias-free conv over an image of at most 4 channels
(a CNN's stem), in `dtype`, written channels_last; passes/pad_channels.py puts it in place of such a conv left to
cuDNN. x and w may be fp32 where the conv read their casts to dtype (autocast's): the kernel casts as it pads.

Paths, recorded in PATHS: "triton" (kernels/conv2d_image.py: the image padded once, then an implicit GEMM over
overlapping views of its rows; on CUDA or under the interpreter) or "reference" (ATen's conv).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from . import library
from .fused import _record, _use_triton, conv_out_shape


def _empty(x: torch.Tensor, w: torch.Tensor, stride, padding, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(conv_out_shape(x, w, stride, padding, (1, 1)), dtype=dtype, device=x.device,
                       memory_format=torch.channels_last)


def image_conv_impl(x: torch.Tensor, w: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
                    dtype: torch.dtype, provider: str) -> torch.Tensor:
    out = _empty(x, w, stride, padding, dtype)
    if _use_triton(x.device, provider):
        from .. import kernels

        _record("image_conv", "", "triton")
        return kernels.image_conv(x, w, stride, padding, out)
    _record("image_conv", "", "reference")
    return out.copy_(F.conv2d(x.to(dtype), w.to(dtype), None, stride, padding))


image_conv = library.Op("image_conv", image_conv_impl)


@image_conv.register_fake
def _(x, w, stride, padding, dtype, provider):
    return _empty(x, w, stride, padding, dtype)
