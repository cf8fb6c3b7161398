"""A conv over an image of at most 4 channels (a CNN's stem: 7x7 stride 2, 3 > 64), as an implicit GEMM whose
im2col rows are overlapping views of the image.

Entry points: `image_conv(x, w, stride, padding, out, operands, signature)`, reached through resfuse.kernels
(ops/image_conv.py's bare op, which passes/pad_channels.py puts in place of such a conv) and through
launch.conv2d for a ConvConfig with `image` (the tuner's candidate for a fused conv over an image, epilogue
included); `refusal(x, w, stride, padding, dilation, groups, dtype, signature)`.

Two launches:
  pad_image_kernel   x padded once (and cast to out's dtype: autocast's fp32 image): to 4 channels, by the
                     conv's padding on every side, and on the right and bottom as far as the last row's reads
                     reach, NHWC, every pixel written (the border too); in the same launch, one program a filter
                     row packs the weight (cast too) into [R, KP, BK] (KP = 4 * S
                     and BK = K, each rounded up to a power of two of at least 16; the slots of the fourth channel,
                     past S and past K are zeros).
  resfuse_image_conv y[m, :] for BM output pixels m = (n, oh, ow) a program, generated per epilogue (`source`)
                     around image_conv_tile. With 4 channels a pixel is 8 bytes,
                     so filter row r's taps of output pixel m are 4 * S consecutive halves of padded row
                     oh * SH + r starting at pixel ow * SW: A_r[m, :] is a row of an overlapping view, read by
                     vector loads (16 bytes at an even stride, else 8), and the conv is R dots of [BM, KP] x
                     [KP, BK]. The KP - 4 * S halves past the window are read but zeroed by a select, so an inf there
                     never meets a zero weight.
cuDNN's first-layer kernel for this conv runs at about 2.5x its floor, and when the image is not padded to 4
channels it pads it itself (passes/pad_channels.py). H100, ResNet-50's stem, both launches against what ran before
(bench/stem_rows.py's "product"; BENCHMARKS.md, thirty-third session), us: bs1 6.8 against 12.2 (cuDNN on 3
channels), bs32 60.6 against 74.9 and bs256 470 against 505 (the image padded for cuDNN, then its conv).
"""
from __future__ import annotations

import textwrap

import torch
import triton
import triton.language as tl

from .. import epilogue as epi
from . import codegen, options
from .chain import nhwc_dense
from .epilogue_source import triton_body, triton_params
from .max_pool import _big, _rows
from .plan import launch, operand_args, operand_strides, pdl_meta
from .tiles import cdiv, dependent_launch, mma

CP = 4  # channels of the padded image: one pixel is 8 bytes at fp16
BM, WARPS = 128, 4  # the best tile of bench/stem_rows.py at bs32 and bs256 (BM 64 to 256, 2 to 8 warps)
PAD_BM = 512  # pixels a program pads: kernels/padding.py's tile for 4 channels, the best of its sweep at bs256
MAX_TAPS = 8  # S * CP halves of a filter row fit a 32-wide reduction block
MAX_OUT = 256  # output channels: one program holds all of them (in a power of two of at least 16)


@triton.jit
def pad_image_kernel(x, w, xp, wp, PIXELS, C, H, W, HP, WP, PH, PW, K, S,
                     s_xn, s_xc, s_xh, s_xw, s_wk, s_wc, s_wr, s_ws,
                     BIG: tl.constexpr, BM: tl.constexpr, CP: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr,
                     PDL: tl.constexpr):
    dependent_launch(PDL)
    pid = tl.program_id(0)
    programs = cdiv(PIXELS, BM)
    if pid < programs:
        p = pid * BM + tl.arange(0, BM)
        n, hh, ww = _rows(p, HP, WP, BIG)
        h = hh - PH
        wc = ww - PW
        ok = p < PIXELS
        inside = ok & (h >= 0) & (h < H) & (wc >= 0) & (wc < W)
        c = tl.arange(0, CP)
        v = tl.load(x + (n * s_xn + h * s_xh + wc * s_xw)[:, None] + (c * s_xc)[None, :],
                    mask=inside[:, None] & (c < C)[None, :], other=0.0)
        if BIG:
            p = p.to(tl.int64)
        tl.store(xp + p[:, None] * CP + c[None, :], v.to(xp.dtype.element_ty), mask=ok[:, None])
    else:  # (names unlike the branch above's: compiled Triton merges a name's type across the branches)
        r = pid - programs
        kk = tl.arange(0, KP)
        tap = kk // CP
        chan = kk % CP
        k = tl.arange(0, BK)
        wv = tl.load(w + k[None, :] * s_wk + (chan * s_wc + r * s_wr + tap * s_ws)[:, None],
                     mask=((tap < S) & (chan < C))[:, None] & (k < K)[None, :], other=0.0)
        tl.store(wp + r * (KP * BK) + kk[:, None] * BK + k[None, :], wv.to(wp.dtype.element_ty))


@triton.jit
def image_conv_tile(xp, wp, m, M, OH, OW, s_xn, s_xh, R,
                    SH: tl.constexpr, SW: tl.constexpr, TAPS: tl.constexpr, ALIGN: tl.constexpr, BIG: tl.constexpr,
                    BM: tl.constexpr, CP: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    """The conv of output pixels m ([BM] numbers of (n, oh, ow)) into [BM, BK] fp32, and each pixel's sample and
    pixel within its sample (the epilogue's s_idx and p_idx)."""
    n, oh, ow = _rows(m, OH, OW, BIG)
    base = tl.multiple_of(n * s_xn + (oh * SH) * s_xh + ow * (SW * CP), ALIGN)
    kk = tl.arange(0, KP)
    co = tl.arange(0, BK)
    ok = (m < M)[:, None]
    acc = tl.full((BM, BK), 0.0, tl.float32)
    for r in tl.range(0, R, num_stages=1):  # pipelining measured slower: 79-89 against 66 us at bs32
        a = tl.load(xp + base[:, None] + r * s_xh + kk[None, :], mask=ok, other=0.0)
        a = tl.where((kk < TAPS)[None, :], a, 0.0)
        b = tl.load(wp + r * (KP * BK) + kk[:, None] * BK + co[None, :])
        acc = mma(a, b, acc, PRECISION)
    return acc, n, oh * OW + ow


def source(signature: str) -> str:
    """The conv kernel with this epilogue (epilogue_source.triton_body), on image_conv_tile."""
    tree = epi.parse(signature)
    consts = ("SH", "SW", "TAPS", "ALIGN", "BIG", "BM", "CP", "KP", "BK", "PRECISION", "PDL")
    params = ["xp", "wp", "y", "M", "OH", "OW", "s_xn", "s_xh", "R", "K", *triton_params(tree),
              *[f"{c}: tl.constexpr" for c in consts]]
    param_lines = "\n".join(f"    {p}," for p in params)
    body = textwrap.indent(triton_body(tree, "y_val", out_ty="y.dtype.element_ty"), " " * 4)
    return f'''"""Generated by resfuse.kernels.conv2d_image (template version {codegen.TEMPLATE_VERSION}); do not edit.

A conv over an image of at most 4 channels. Epilogue: {signature}
"""
import triton
import triton.language as tl

from resfuse.kernels.activations import {", ".join(codegen.HELPERS)}
from resfuse.kernels.conv2d_image import image_conv_tile
from resfuse.kernels.tiles import dependent_launch


@triton.jit
def resfuse_image_conv(
{param_lines}
):
    dependent_launch(PDL)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    acc, s_idx, p_idx = image_conv_tile(xp, wp, m, M, OH, OW, s_xn, s_xh, R, SH, SW, TAPS, ALIGN, BIG, BM, CP, KP,
                                        BK, PRECISION)
    offs_c = tl.arange(0, BK)
    mask_c = offs_c < K
    row_ok = m < M
    mask = row_ok[:, None] & mask_c[None, :]
    # epilogue: {signature}
{body}
    if BIG:
        m = m.to(tl.int64)
    tl.store(y + m[:, None] * K + offs_c[None, :], y_val.to(y.dtype.element_ty), mask=mask)
'''


def refusal(x: torch.Tensor, w: torch.Tensor, stride, padding, dilation, groups: int,
            dtype: torch.dtype | None = None, signature: str = "acc") -> str | None:
    """Why image_conv cannot run this conv in `dtype` (None: x's) with this epilogue (None: it can). x and w may be
    fake tensors (a graph's values), and fp32 where the conv reads their casts to dtype (the padding kernel casts)."""
    dtype = dtype or x.dtype
    tree = epi.parse(signature)
    if epi.aux_value(tree) is not None or epi.stats_node(tree) is not None:
        return "an epilogue with a second output"
    if x.dim() != 4 or w.dim() != 4 or groups != 1 or tuple(dilation) != (1, 1):
        return "a 2-D conv, groups 1, dilation 1"
    if dtype not in (torch.float16, torch.bfloat16) or not {x.dtype, w.dtype} <= {dtype, torch.float32}:
        return f"an fp16/bf16 conv, of inputs in its dtype or fp32: got {x.dtype} and {w.dtype} for {dtype}"
    k, c, r, s = w.shape
    if c > CP or x.shape[1] != c:
        return f"{x.shape[1]} input channels, above {CP}"
    if s > MAX_TAPS or k > MAX_OUT:
        return f"a {r}x{s} filter with {k} outputs: at most {MAX_TAPS} wide and {MAX_OUT} outputs"
    if any(not isinstance(d, int) for d in (*x.shape, *stride, *padding)) or min(stride) < 1:
        return "a dynamic shape"
    return None


def padded_size(x: torch.Tensor, w: torch.Tensor, stride, padding, oh: int, ow: int) -> tuple[int, int]:
    """(HP, WP): the padded image's rows and columns, enough for every read of an OH x OW output (the last output
    column reads KP // CP pixels from ow * SW), columns a multiple of 4 so that a row is a multiple of 16 bytes
    (Triton then knows its stride's alignment)."""
    _, _, h, wd = x.shape
    _, _, r, s = w.shape
    hp = max(h + 2 * padding[0], (oh - 1) * stride[0] + r)
    wp = max(wd + 2 * padding[1], (ow - 1) * stride[1] + _block(s * CP) // CP)
    return hp, wp + -wp % 4


def _block(n: int) -> int:
    """A reduction or channel block of n: a power of two, at least 16 (a tensor-core dot's least)."""
    return max(16, triton.next_power_of_2(n))


def image_conv(x: torch.Tensor, w: torch.Tensor, stride, padding, out: torch.Tensor, operands=(),
               signature: str = "acc") -> torch.Tensor:
    """out = epilogue(conv2d(x, w, stride, padding)) into the preallocated dense channels_last out, in out's dtype:
    x and w are cast to it as they are padded and packed."""
    if not nhwc_dense(out):
        raise NotImplementedError("the image conv writes a dense channels_last output")
    if out.numel() == 0:
        return out
    n, c, h, wd = x.shape
    k, _, r, s = w.shape
    oh, ow = out.shape[2:]
    hp, wp = padded_size(x, w, stride, padding, oh, ow)
    kp, bk = _block(s * CP), _block(k)
    xp = torch.empty((n, hp, wp, CP), dtype=out.dtype, device=x.device)
    packed = torch.empty((r, kp, bk), dtype=out.dtype, device=x.device)
    pixels = n * hp * wp
    big = _big(x, xp, out)
    pdl = pdl_meta(x.device)
    launch(pad_image_kernel, (triton.cdiv(pixels, PAD_BM) + r,),
        x, w, xp, packed, pixels, c, h, wd, hp, wp, padding[0], padding[1], k, s, *x.stride(), *w.stride(),
        BIG=big, BM=PAD_BM, CP=CP, KP=kp, BK=bk, num_warps=WARPS, **pdl)
    m = n * oh * ow
    upcast = out.dtype == torch.bfloat16 and options()["interpret"]  # see tiles.mma
    kernel = codegen.load_source("image_conv", signature, lambda: source(signature))
    ops = operand_args(operands, operand_strides(signature, operands, out.shape, 1), {}, signature, out.shape, 1)
    launch(kernel, (triton.cdiv(m, BM),),
        xp, packed, out, m, oh, ow, xp.stride(0), xp.stride(1), r, k, *ops, SH=stride[0], SW=stride[1],
        TAPS=s * CP, ALIGN=8 if stride[1] % 2 == 0 else 4, BIG=big, BM=BM, CP=CP, KP=kp, BK=bk,
        PRECISION="upcast" if upcast else "ieee", num_warps=WARPS, num_stages=1, **pdl)
    return out
