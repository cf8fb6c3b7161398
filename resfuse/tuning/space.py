"""The tuning space per level: which kernel configs the triton provider offers for one fused op.

Entry point: `configs(call, level)`. The space itself is declared beside each kernel (`SPACE` and the
config's `check` in kernels/matmul.py, kernels/conv2d_fprop.py, kernels/conv2d_depthwise.py,
kernels/conv2d_bwd_data.py, kernels/chain.py and kernels/shortcut.py); here it is pruned by level:
  none  the heuristic default only (no tuning);
  fast  the default and a few tile shapes around it that suit Hopper (the default level); for the chain kernel
        and the shortcut kernel, the default and its whole space (eight, and 16 or 28 configs of one form);
        for a conv whose default tiles under-fill the GPU, also 32 x 64 tiles split for their own count
        (conv2d_fprop.few_rows_config); for a GEMM or a 1x1 conv of at most SWAP_ROWS rows of one sample, also
        its swapped form (GemmConfig.swap, SWAP_TILES); for a conv over an image of at most 4 channels, also the
        image conv (at this level and at max);
  max   every point of SPACE that passes `check` (hundreds of compiles: slow).
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
from triton import cdiv

from .. import kernels
from ..kernels import chain, conv2d_bwd_data, conv2d_depthwise, conv2d_fprop, launch, matmul, shortcut
from ..kernels.launch import sm_count

# (block_m, block_n, num_warps, num_stages) tried by "fast", besides the heuristic default
FAST_TILES = ((128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4), (128, 256, 8, 3), (256, 128, 8, 3),
              (64, 64, 4, 4))
# For a GEMM, 1x1 conv or 1x1 dgrad whose operands TMA descriptors can read, those tiles run on the TMA
# mainloop, and the default runs on both: every TMA twin beat its pointer twin on the three such cases of
# `bench/kernels.py --sweep` (H200, fp16 with the epilogue: BERT qkv 37.4 -> 32.2 us, ffn1 133.5 -> 116.6, ResNet
# 1x1 64>256 tail at bs32 80.2 -> 54.2, best against best), so the pointer twins would only cost compiles.
# Tiles whose TMA configs "fast" also offers persistent (2 programs an SM, matmul.PERSISTENT_FAMILY): the
# best persistent config of `bench/persistent.py` on each of its cases (H100, bs256 ResNet-50 1x1 convs and
# ConvNeXt/BERT GEMMs) used one of these, and beat the best one-tile-per-program config by up to 1.31x.
PERSISTENT_TILES = ((128, 64), (128, 128), (256, 128))
# For a product of at most SWAP_ROWS rows of one sample (a 1x1 conv or a linear layer at batch 1), "fast" also
# offers it swapped (GemmConfig.swap: the output's channels tile the rows) in these (channels, rows) tiles, split
# by the heuristic's rule and unsplit: the best swapped tiles of bench/swap_ab.py on ResNet-50's bs1 1x1 convs
# (H100, forty-fourth session; 64 x 16 split 4 took layer 4's 2048 -> 512 conv in 5.15 us, against 5.55 for the
# tuner's best before).
SWAP_TILES = ((64, 16), (64, 32))
SWAP_ROWS = 256
LEVELS = ("none", "fast", "max")
MODULES = {"conv2d": conv2d_fprop, "gemm": matmul, "conv2d_dgrad": conv2d_bwd_data,  # op -> its kernel's space
           "conv2d_chain": chain, "conv2d_shortcut": shortcut}


def module(call):
    """The kernel module whose space serves `call`: a depthwise conv has its own family."""
    if call.op == "conv2d" and conv2d_depthwise.is_depthwise(*(t.shape for t in call.inputs)):
        return conv2d_depthwise
    return MODULES[call.op]


def config(call, fields: dict):
    """A cached entry's config fields, as the config class of `call`'s kernel family."""
    return type(module(call).default_config(problem(call)))(**fields)


def problem(call):
    dev = call.out.device
    if call.op == "conv2d":
        x, w = call.inputs
        oh, ow = call.out.shape[2:]
        stride, _, dilation = call.params
        return conv2d_fprop.ConvProblem(x.shape[0], x.shape[1], w.shape[0], w.shape[2], w.shape[3], oh, ow,
                                        x.element_size(), sm_count(dev), stride[1] == dilation[1] == 1)
    if call.op == "conv2d_chain":
        x, w1, w2 = call.inputs
        return chain.ChainProblem(call.out.shape[0] * call.out.shape[2] * call.out.shape[3], x.shape[1], w1.shape[0],
                                  w2.shape[0], x.element_size(), sm_count(dev))
    if call.op == "conv2d_shortcut":
        from ..ops import shortcut as op

        y, w1, x, _ = call.inputs
        return shortcut.ShortcutProblem(call.out.shape[0] * call.out.shape[2] * call.out.shape[3], y.shape[1],
                                        x.shape[1], w1.shape[0], y.element_size(), sm_count(dev), op.foldable(call))
    if call.op == "conv2d_dgrad":
        grad_out, w = call.inputs
        stride = call.params[0]
        n, c, h, wd = call.out.shape
        return conv2d_bwd_data.DgradProblem(n, c, w.shape[0], w.shape[2], w.shape[3], h, wd, stride[0], stride[1],
                                            w.element_size(), sm_count(dev))
    a, b = call.inputs
    batch = a.shape[0] if a.dim() == 3 else 1
    return matmul.GemmProblem(batch, a.shape[-2], b.shape[-1], a.shape[-1], a.element_size(), sm_count(dev))


def _tma_gemm(call) -> bool:
    """The op runs on the GEMM's TMA mainloops: a GEMM, 1x1 conv or 1x1 dgrad whose operands descriptors read."""
    if call.op == "gemm":
        return launch.tma_operands(*call.inputs) is not None
    if call.op == "conv2d_dgrad":
        return launch.dgrad_as_gemm(*call.inputs, *call.params[:2], call.out.strides) is not None
    if call.op == "conv2d":
        return launch.conv_as_gemm(*call.inputs, *call.params[:2], call.out.strides) is not None
    return False


def _tma_readable(call) -> bool:
    """A TMA mainloop runs the op: the GEMM's, or for a stride-1 conv the box mainloop (conv2d_tma_mainloop)."""
    return _tma_gemm(call) or (call.op == "conv2d"
                               and launch.conv_tma_operands(*call.inputs, call.params[0]) is not None)


def bulk_store_twin(call, cfg):
    """cfg with its output written by bulk TMA stores (tma_store), where that would change the kernel: a GEMM,
    1x1 conv or 1x1 dgrad on the TMA mainloops, unsplit, into an fp16/bf16 output, with the option on; else None.
    Per config, bulk stores measured 0.73-1.33x per-thread stores (bench/persistent.py --stores, BENCHMARKS.md
    twenty-ninth session), so the tuner times both where a config is shortlisted."""
    if (not kernels.options()["tma_store"] or not getattr(cfg, "tma", False) or cfg.split_k != 1
            or call.out.dtype not in (torch.float16, torch.bfloat16)):
        return None
    if not _tma_gemm(call):
        return None
    twin = dataclasses.replace(cfg, tma_store=True)
    return twin if twin.check(problem(call)) else None


def configs(call, level: str) -> list:
    if level not in LEVELS:
        raise ValueError(f"tuning level {level!r}: one of {LEVELS}")
    family = module(call)
    p = problem(call)
    default = family.default_config(p)
    if level == "none":
        return [default]
    pair = family in (chain, shortcut)  # a kernel of two convs: its whole space is a handful of configs
    if level == "max" or pair:
        cls = type(default)
        points = (cls(**dict(zip(family.SPACE, values))) for values in itertools.product(*family.SPACE.values()))
        found = [default] * pair + [c for c in points if c.check(p)]
    elif family is conv2d_depthwise:
        found = conv2d_depthwise.fast_configs(default, p)
    else:
        tma = _tma_readable(call)
        found = [default] + [dataclasses.replace(default, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns,
                                                 **({"tma": True} if tma else {}))
                             for bm, bn, nw, ns in FAST_TILES]
        if default.split_k > 1:
            found.append(dataclasses.replace(default, split_k=1, **({"tma": True} if tma else {})))
        if tma:
            found.append(dataclasses.replace(default, tma=True))
            found += [dataclasses.replace(c, persistent=2) for c in found
                      if c.tma and c.split_k == 1 and (c.block_m, c.block_n) in PERSISTENT_TILES]
        if family is conv2d_fprop and conv2d_fprop.tiles(default, p) < p.sms:
            found.append(conv2d_fprop.few_rows_config(p, tma=_tma_gemm(call)))
        found += swapped_configs(call, p, default)
    if not _tma_readable(call):
        found = [c for c in found if not getattr(c, "tma", False)]  # it would run the pointer mainloop: a duplicate
    if family is conv2d_fprop and image_refusal(call) is None:
        found.append(dataclasses.replace(default, image=True))
    return [c for c in dict.fromkeys(found) if c.check(p)]


def swapped_configs(call, p, default) -> list:
    """The swapped configs "fast" offers a GEMM or a 1x1 conv of few rows of one sample (SWAP_TILES, SWAP_ROWS);
    none for others. A conv's must also be a plain GEMM (launch.is_gemm_conv); check() drops the rest."""
    if call.op == "gemm":
        rows, cols, k, samples = p.m, p.n, p.k, p.batch
    elif call.op == "conv2d" and launch.is_gemm_conv(*call.inputs, *call.params[:2], call.out.strides):
        rows, cols, k, samples = p.m, p.k, p.c, p.n
    else:
        return []
    if samples != 1 or rows > SWAP_ROWS:
        return []
    found = []
    for bm, bn in SWAP_TILES:
        split = matmul.split_k_heuristic(cdiv(cols, bm) * cdiv(rows, bn), cdiv(k, default.block_k), p.sms)
        found += [dataclasses.replace(default, block_m=bm, block_n=bn, split_k=s, num_warps=4, num_stages=3, swap=True,
                                      tma=False, ws=False, persistent=0, tma_store=False)
                  for s in dict.fromkeys((split, 1))]
    return found


def image_refusal(call) -> str | None:
    """Why the image conv (kernels/conv2d_image.py) is no candidate for this fused conv (None: it is one)."""
    from ..kernels import conv2d_image
    from ..ops.fused import dense_strides

    x, w = call.inputs
    stride, padding, dilation = call.params
    if call.out.strides != dense_strides(call.out.shape, torch.channels_last):
        return "an output that is not dense channels_last"
    return conv2d_image.refusal(x, w, stride, padding, dilation, 1, call.out.dtype, call.signature)
