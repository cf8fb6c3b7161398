"""resfuse::pad_channels(x, channels, dtype, provider): a 4-D image with its channels zero-padded to `channels`,
cast to `dtype`, channels_last; passes/pad_channels.py puts it ahead of a 3-channel conv run by cuDNN.

Paths, recorded in PATHS: "triton" (kernels/padding.py, on CUDA or under the interpreter) or "reference"
(ATen's cast and pad).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import library
from .fused import _record, _use_triton


def _empty(x: torch.Tensor, channels: int, dtype: torch.dtype) -> torch.Tensor:
    n, _, h, w = x.shape
    return torch.empty((n, channels, h, w), dtype=dtype, device=x.device, memory_format=torch.channels_last)


def pad_channels_impl(x: torch.Tensor, channels: int, dtype: torch.dtype, provider: str) -> torch.Tensor:
    out = _empty(x, channels, dtype)
    if _use_triton(x.device, provider):
        from .. import kernels

        _record("pad_channels", "", "triton")
        return kernels.pad_channels(x, out)
    _record("pad_channels", "", "reference")
    return out.copy_(F.pad(x.to(dtype), (0, 0, 0, 0, 0, channels - x.shape[1])))


pad_channels = library.Op("pad_channels", pad_channels_impl)


@pad_channels.register_fake
def _(x, channels, dtype, provider):
    return _empty(x, channels, dtype)
