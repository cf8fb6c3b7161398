"""A 4-D image's channels zero-padded to a wider count, cast on the way: out[n, c, h, w] = x[n, c, h, w] for
c < C, else 0, in out's dtype and layout.

Entry point: `pad_channels(x, out)`, reached through resfuse.kernels (ops/padding.py's pad_channels op, which
passes/pad_channels.py puts ahead of a 3-channel conv). cuDNN pads a 3-channel NHWC fp16 image to 4 channels
itself, in a pass of its own (nhwcAddPadding) before each first-layer conv and weight gradient; reading the
image already padded skips that pass and its memset. This kernel does the padding in the pass that already
reads the image: autocast's cast from fp32. One program writes [BM pixels, BC channels], BC the padded count's
power of two, so a channels_last output is written in whole rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .max_pool import _big, _rows
from .plan import launch, pdl_meta
from .tiles import dependent_launch


@triton.jit
def pad_channels_kernel(x, out, N, C, CO, H, W, s_xn, s_xc, s_xh, s_xw, s_on, s_oc, s_oh, s_ow,
                        BIG: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    dependent_launch(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_c = tl.arange(0, BC)
    n, h, w = _rows(rows, H, W, BIG)
    row_ok = (rows < N * H * W)[:, None]
    v = tl.load(x + (n * s_xn + h * s_xh + w * s_xw)[:, None] + (offs_c * s_xc)[None, :],
                mask=row_ok & (offs_c < C)[None, :], other=0.0)
    tl.store(out + (n * s_on + h * s_oh + w * s_ow)[:, None] + (offs_c * s_oc)[None, :],
             v.to(out.dtype.element_ty), mask=row_ok & (offs_c < CO)[None, :])


def pad_channels(x: torch.Tensor, out: torch.Tensor, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """tile: (pixels a program, warps), for bench/stem_pad.py's sweep."""
    n, c, h, w = x.shape
    co = out.shape[1]
    if out.numel():
        bc = triton.next_power_of_2(co)
        bm, warps = tile or (max(32, 2048 // bc), 4)  # 512 x 4: the best of 8 tiles at bs256 (stem_pad.py --sweep)
        launch(pad_channels_kernel, (triton.cdiv(n * h * w, bm),),
            x, out, n, c, co, h, w, *x.stride(), *out.stride(), BIG=_big(x, out), BM=bm, BC=bc, num_warps=warps,
            **pdl_meta(x.device))
    return out
