"""Launching the fused kernels: argument checks, [S, P, C] operand views, config choice and the grid.

Entry points: `conv2d(x, w, operands, signature, stride, padding, dilation, out, config=None, aux=None) -> out`,
`conv2d_dgrad(grad_out, w, operands, signature, stride, padding, dilation, out, config=None) -> out` and
`gemm(a, b, operands, signature, out, config=None) -> out`, reached through resfuse.kernels (ops/fused.py calls
those; the epilogue alone, on an accumulator in memory, is elementwise.py's; which mainloop can read the operands,
views.py's). A None config is the heuristic default; the tuner passes measured ones. `out` is preallocated by the
caller; the kernels write into it through its own strides. An epilogue with an aux node also writes `aux` (conv2d
and gemm take it), laid out like `out`. An epilogue with a bn_stats root also writes `stats`, fp32 [2, C]
(conv2d_dgrad takes it): each row block's sums go to a [2, C, row blocks] workspace, which one torch.sum then adds
up in a fixed order, along its contiguous last dim.
"""
from __future__ import annotations

import dataclasses

import torch
import triton

from .. import epilogue as epi
from . import codegen, options
from .plan import _PLANS, Plan, cached_launch, check_outputs, descriptor_operands, descriptor_output  # noqa: F401
from .plan import operand_strides, pdl_meta  # noqa: F401
from .plan import plan_key, sm_count  # noqa: F401  (tests and bench scripts reach them through launch)
from .elementwise import channel_vector
from .conv2d_bwd_data import FAMILY as DGRAD_FAMILY, DgradConfig, DgradProblem, tap_inverse
from .conv2d_bwd_data import default_config as dgrad_config
from .conv2d_fprop import FAMILY as CONV_FAMILY, TMA_FAMILY as CONV_TMA_FAMILY, ConvConfig, ConvProblem, tma_box
from .conv2d_fprop import default_config as conv_config
from .conv2d_depthwise import FAMILY as DEPTHWISE_FAMILY, DepthwiseConfig, is_depthwise, pixel_alignment
from .conv2d_depthwise import default_config as depthwise_config
from .matmul import FAMILY as GEMM_FAMILY, PERSISTENT_FAMILY, TMA_FAMILY as GEMM_TMA_FAMILY, GemmConfig, GemmProblem
from .matmul import default_config as gemm_config
from .views import conv_as_gemm, conv_tma_operands, dgrad_as_gemm, gemm_views, is_gemm_conv, tma_operands  # noqa: F401

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)



def _check_inputs(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    # out may be fp32 for fp16/bf16 inputs: an epilogue under a float32 marker (mixed precision)
    if p.dtype not in _DTYPES or q.dtype != p.dtype or out.dtype not in (p.dtype, torch.float32):
        raise TypeError(f"resfuse kernels need matching fp16/bf16/fp32 inputs and output, got "
                        f"{p.dtype}, {q.dtype} -> {out.dtype}")
    if not (p.device == q.device == out.device):
        raise ValueError(f"inputs and output on different devices: {p.device}, {q.device}, {out.device}")


def _split(config_split: int) -> int:
    forced = options()["split_k"]
    return int(forced) if forced is not None else config_split


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16 and options()["interpret"]:
        return "upcast"  # see tiles.mma: the interpreter's bf16 dot is broken
    # fp32 runs as tf32 on tensor cores (what cuBLAS does with allow_tf32); fp16/bf16 ignore this
    return "tf32" if dtype == torch.float32 else "ieee"


def _gemm_out_view(out: torch.Tensor, batched: bool, m: int, n: int) -> tuple[int, int, int, int, int]:
    """(rows per sample, batch, sample, row and column strides) of `out` as the kernel writes it.

    `out` is the product's shape, or (for an [M, K] @ [K, N]) a view of it that keeps the last dim, such as
    the [B, S, N] of a linear layer; the epilogue's samples are then out.shape[0] (see epilogue.rows3).
    """
    if batched:
        if out.dim() != 3:
            raise NotImplementedError(f"a batched gemm writes a [B, M, N] output, got {tuple(out.shape)}")
        return m, out.stride(0), 0, out.stride(1), out.stride(2)
    if out.dim() == 2:
        return m, 0, 0, out.stride(0), out.stride(1)
    samples = out.shape[0]
    try:
        o3 = out.view(samples, m // samples, n)
    except RuntimeError as e:
        raise NotImplementedError(f"gemm output {tuple(out.shape)} with strides {out.stride()} is not a "
                                  f"[samples, rows, N] view") from e
    return m // samples, 0, o3.stride(0), o3.stride(1), o3.stride(2)



def gemm(a: torch.Tensor, b: torch.Tensor, operands, signature: str, out: torch.Tensor,
         config: GemmConfig | None = None, aux: torch.Tensor | None = None) -> torch.Tensor:
    key = plan_key("gemm", signature, config, options()["split_k"], a, b, out, aux, *operands)
    return cached_launch(key, lambda: _gemm_plan(a, b, operands, signature, out, config), (a, b), out, operands,
                          signature, -1, aux)


def _gemm_plan(a, b, operands, signature, out, config) -> Plan | None:
    _check_inputs(a, b, out)
    if a.dim() not in (2, 3) or b.dim() not in (2, 3) or b.dim() > a.dim():
        raise NotImplementedError(f"gemm kernel takes [M,K]@[K,N], [B,M,K]@[B,K,N] or [B,M,K]@[K,N]; got "
                                  f"{tuple(a.shape)} @ {tuple(b.shape)}")
    if out.numel() == 0:
        return None
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2:]
    n = b.shape[-1]
    s_ab = a.stride(0) if a.dim() == 3 else 0
    s_bb = b.stride(0) if b.dim() == 3 else 0  # a 2-D B is shared by every batch
    paired = epi.paired(epi.parse(signature))  # a GLU's: the output has half the product's columns
    if out.shape[-1] * (1 + paired) != n or (paired and n % 2):  # a wrong width would be written past its end
        raise ValueError(f"the product's {n} columns do not fit the output's {out.shape[-1]} "
                         f"({'a GLU epilogue pairs them' if paired else 'unpaired'})")
    rps, s_ob, s_os, s_om, s_on = _gemm_out_view(out, a.dim() == 3, m, out.shape[-1])
    cfg = config or gemm_config(GemmProblem(batch, m, n, k, a.element_size(), sm_count(a.device)))
    if paired and cfg.swap:
        raise NotImplementedError("a swapped tile cannot pair a GLU's columns (they are its rows)")
    if cfg.swap:
        if a.dim() != 2 or b.dim() != 2 or rps != m:
            raise NotImplementedError("a swapped config runs a 2-D product whose output is one sample")
        return _swapped_plan((a, b), operands, signature, out, -1, cfg, s_om, s_on)
    split = _split(cfg.split_k)
    tiles_mn = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if cfg.tma and tma_operands(a, b) is not None:
        return _tma_plan(lambda a, b: (a, b), (a, b), operands, signature, out, -1, cfg, split, tiles_mn,
                         (rps, s_os, s_om, s_on))
    head = [m, n, k, rps, s_ab, a.stride(-2), a.stride(-1), s_bb, b.stride(-2), b.stride(-1), s_ob, s_os, s_om, s_on]
    meta = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split,
                EVEN_K=k % cfg.block_k == 0, PRECISION=_precision(a.dtype),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return Plan(codegen.load(GEMM_FAMILY, signature), (tiles_mn, batch, split), head,
                operand_strides(signature, operands, out.shape, -1), meta,
                (tiles_mn * batch, split, cfg.block_m, cfg.block_n), out.device,
                row_blocks=batch * triton.cdiv(m, cfg.block_m))


def _swapped_plan(matrices, operands, signature, out, channel_dim, cfg, s_row, s_col) -> Plan:
    """The plan of a product A [M, K] @ B [K, N] (`matrices`, views of the call's two inputs) computed as its
    transpose, out^T = B^T A^T, on the GEMM's pointer mainloop (GemmConfig.swap, ConvConfig.swap). For few rows (a
    1x1 conv at batch 1: ResNet-50's layer 4 has 49 pixels), tiles of 32 or 64 rows waste most of each MMA; swapped,
    the weight's output channels fill the tile's rows and the pixels its columns (16 to 64). bench/swap_ab.py
    measured such tiles 0.14-1.04 us faster than the plain ones of the same kernel on ResNet-50's bs1 1x1 convs
    (H100, forty-fourth session). The epilogue reads its operands with the tile's roles swapped (codegen's swap);
    s_row and s_col are out's strides along the product's rows and columns. The kernel takes the call's inputs
    swapped, as pointers: the matrices are views of them at their offsets."""
    a, b = matrices
    if epi.stats_node(epi.parse(signature)) is not None:
        raise NotImplementedError("a swapped tile sums no statistics")
    (m, k), n = a.shape, b.shape[1]
    split = _split(cfg.split_k)
    tiles = triton.cdiv(n, cfg.block_m) * triton.cdiv(m, cfg.block_n)
    head = [n, m, k, n, 0, b.stride(1), b.stride(0), 0, a.stride(1), a.stride(0), 0, 0, s_col, s_row]
    meta = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split,
                EVEN_K=k % cfg.block_k == 0, PRECISION=_precision(a.dtype),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return Plan(codegen.load(GEMM_FAMILY, signature, swap=True), (tiles, 1, split), head,
                operand_strides(signature, operands, out.shape, channel_dim), meta,
                (tiles, split, cfg.block_m, cfg.block_n), out.device, prepare=lambda p, q: (q, p),
                row_blocks=triton.cdiv(n, cfg.block_m))


def _tma_plan(as_matrices, inputs, operands, signature, out, channel_dim, cfg, split, tiles_mn, out_view) -> Plan:
    """A plan for the TMA mainloop. `as_matrices(*inputs)` gives the product's A [M, K] and B [K, N] (views);
    each call turns them into tensor descriptors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    a, b = as_matrices(*inputs)
    _, b_kn = tma_operands(a, b)
    (m, k), n = a.shape, b.shape[1]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    b_box = [bk, bn] if b_kn else [bn, bk]

    def b_matrix(b):  # the matrix B's descriptor reads: B itself, or the [N, K] matrix B is a view of
        return b if b_kn else b.t()

    def descriptors(*inputs):  # and B's matrix itself, for the weight prefetch (matmul.gemm_tma_prefetch)
        a, b = as_matrices(*inputs)
        b_mat = b_matrix(b)
        return TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b_mat, b_box), b_mat

    rps, s_os, s_om, s_on = out_view
    s_b = b_matrix(b).stride(0)
    meta = dict(BM=bm, BN=bn, BK=bk, GROUP_M=cfg.group_m, SPLIT_K=split, B_KN=b_kn,
                PRECISION=_precision(a.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    strides = operand_strides(signature, operands, out.shape, channel_dim)
    # a split's epilogue runs only in its last program, so the others must not load the operands: pointers; a GLU's
    # tile is half as wide as its product's (codegen._pairing): pointers too, and per-thread stores
    paired = epi.paired(epi.parse(signature))
    boxes = descriptor_operands(signature, operands, out.shape, channel_dim, m, n, [bm, bn]) if (
        split == 1 and not paired) else {}
    slots = tuple(sorted(boxes))
    # the output as one [M, N] matrix (its samples' rows merged, channels contiguous): written by bulk stores
    merged = s_on == 1 and (rps == 1 or rps >= m or s_os == rps * s_om)
    row = s_om if rps > 1 else s_os if m > 1 else n  # one row: any stride would do
    smem = cfg.num_stages * (bm + bn) * bk * a.element_size() + len(boxes) * bm * bn * 2
    bulk = cfg.tma_store and merged and split == 1 and not paired
    out_box = descriptor_output(out, m, n, row, [bm, bn], smem) if bulk else None
    family = PERSISTENT_FAMILY if cfg.persistent and split == 1 else GEMM_TMA_FAMILY
    kernel = codegen.load(family, signature, slots, out_box is not None)
    if cfg.persistent and split == 1:
        programs = min(tiles_mn, cfg.persistent * sm_count(a.device))
        return Plan(kernel, (programs, 1, 1), [m, n, k, rps, s_os, s_om, s_b, tiles_mn, s_on], strides, meta,
                    (tiles_mn, 1, bm, bn), out.device, descriptors, triton.cdiv(m, bm), boxes, out_box)
    return Plan(kernel, (tiles_mn, 1, split), [m, n, k, rps, s_os, s_om, s_b, s_on], strides, dict(meta, WS=cfg.ws),
                (tiles_mn, split, bm, bn), out.device, descriptors, triton.cdiv(m, bm), boxes, out_box)


def conv2d(x: torch.Tensor, w: torch.Tensor, operands, signature: str, stride, padding, dilation,
           out: torch.Tensor, config: ConvConfig | DepthwiseConfig | None = None,
           aux: torch.Tensor | None = None) -> torch.Tensor:
    if getattr(config, "image", False):  # the tuner offers it where space.image_refusal says it may
        from .conv2d_image import image_conv

        if aux is not None or tuple(dilation) != (1, 1):
            raise NotImplementedError("the image conv takes no aux output and no dilation")
        return image_conv(x, w, stride, padding, out, operands, signature)
    if is_depthwise(x.shape, w.shape):
        key = plan_key("depthwise", signature, tuple(stride), tuple(padding), tuple(dilation), config, x, w, out,
                       aux, *operands)
        return cached_launch(
            key, lambda: _depthwise_plan(x, w, operands, signature, stride, padding, dilation, out, config),
            (x, w), out, operands, signature, 1, aux)
    key = plan_key("conv2d", signature, tuple(stride), tuple(padding), tuple(dilation), config, options()["split_k"],
               x, w, out, aux, *operands)
    return cached_launch(key, lambda: _conv_plan(x, w, operands, signature, stride, padding, dilation, out, config),
                          (x, w), out, operands, signature, 1, aux)


def _conv_plan(x, w, operands, signature, stride, padding, dilation, out, config) -> Plan | None:
    _check_inputs(x, w, out)
    nb, c, h, wd = x.shape
    ko, cw, r, s = w.shape
    if cw != c:
        raise NotImplementedError(f"conv2d kernel supports groups=1 only (input C={c}, weight C={cw})")
    oh, ow = out.shape[2:]
    if out.numel() == 0:
        return None
    cfg = config or conv_config(ConvProblem(nb, c, ko, r, s, oh, ow, x.element_size(), sm_count(x.device)))
    split = _split(cfg.split_k)
    tiles = triton.cdiv(nb * oh * ow, cfg.block_m) * triton.cdiv(ko, cfg.block_n)
    s_on, s_ok, s_oh, s_ow = out.stride()
    if cfg.swap:
        if nb != 1 or not is_gemm_conv(x, w, stride, padding, out.stride()):
            raise NotImplementedError("a swapped config runs a 1x1, stride-1 conv of one channels_last image")
        return _swapped_plan(gemm_views(x, w), operands, signature, out, 1, cfg, s_ow, s_ok)
    if cfg.tma and conv_as_gemm(x, w, stride, padding, out.stride()) is not None:  # a 1x1 conv as a GEMM
        return _tma_plan(gemm_views, (x, w), operands, signature, out, 1, cfg, split, tiles,
                         (oh * ow, s_on, s_ow, s_ok))
    if cfg.tma and conv_tma_operands(x, w, stride) is not None:
        return _tma_conv_plan(x, w, operands, signature, out, cfg, split, padding, dilation)
    head = [nb, h, wd, c, ko, oh, ow, r, s, *x.stride(), *w.stride(), s_on, s_oh, s_ow, stride[0], stride[1],
            padding[0], padding[1], dilation[0], dilation[1], s_ok]
    meta = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split, FLAT=cfg.flat,
                PRECISION=_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # A 1x1 conv on this kernel (a strided one: the others run as GEMMs) launches without programmatic dependent
    # launch. With it, ResNet-50 bs1's CUDA graph on an H200, whose tuner put layer 4's stride-2 shortcut conv
    # here, computed every replay wrong (relative error 1.2), and right with PDL off for this family's plans; its
    # 3x3 convs keep PDL, which H100 graphs replay right and 2.6% faster at bs1 (bench/replay_check.py
    # --plans-pdl, thirty-eighth session). Its SASS waits (ACQBULK) before its first load; the cause is not found.
    return Plan(codegen.load(CONV_FAMILY, signature), (tiles, 1, split), head,
                operand_strides(signature, operands, out.shape, 1), meta, (tiles, split, cfg.block_m, cfg.block_n),
                out.device, row_blocks=triton.cdiv(nb * oh * ow, cfg.block_m), pdl=(r, s) != (1, 1))


def _depthwise_plan(x, w, operands, signature, stride, padding, dilation, out, config) -> Plan | None:
    _check_inputs(x, w, out)
    nb, c, h, wd = x.shape
    ko, _, r, s = w.shape
    oh, ow = out.shape[2:]
    if out.numel() == 0:
        return None
    problem = ConvProblem(nb, c, ko, r, s, oh, ow, x.element_size(), sm_count(x.device),
                          stride[1] == dilation[1] == 1)
    cfg = config or depthwise_config(problem)
    if cfg.strip and not cfg.check(problem):
        cfg = dataclasses.replace(cfg, strip=0)  # a strip tile given for a conv it does not fit: the per-tap loop
    tiles = nb * triton.cdiv(oh, cfg.block_h) * triton.cdiv(ow, cfg.block_w) * triton.cdiv(ko, cfg.block_n)
    s_on, s_ok, s_oh, s_ow = out.stride()
    s_wk, _, s_wr, s_ws = w.stride()
    vec, kv = pixel_alignment(x), channel_vector(ko, s_on, s_oh, s_ow)
    s_xn, s_xc, s_xh, s_xw = x.stride()
    head = [nb, h, wd, c, ko, oh, ow, r, ko // c, s_xn // vec, s_xc, s_xh // vec, s_xw // vec, s_wk, s_wr, s_ws,
            s_on // kv, s_oh // kv, s_ow // kv, stride[0], stride[1], padding[0], padding[1], dilation[0],
            dilation[1], s_ok]
    meta = dict(BM=cfg.block_m, BN=cfg.block_n, BH=cfg.block_h, BW=cfg.block_w, S=s, VEC=vec, WS=cfg.strip, KV=kv,
                SPLIT_K=1, num_warps=cfg.num_warps)
    return Plan(codegen.load(DEPTHWISE_FAMILY, signature), (tiles, 1, 1), head,
                operand_strides(signature, operands, out.shape, 1), meta, (tiles, 1, cfg.block_m, cfg.block_n),
                out.device, row_blocks=tiles // triton.cdiv(ko, cfg.block_n))


def _tma_conv_plan(x, w, operands, signature, out, cfg, split, padding, dilation) -> Plan:
    """A plan for conv2d_tma_mainloop: each call makes the NHWC input's and KRSC weight's descriptors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    nb, c, h, wd = x.shape
    ko, _, r, s = w.shape
    oh, ow = out.shape[2:]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    bh, bw = tma_box(bm, nb, oh, ow, (r - 1) * dilation[0] + 1, (s - 1) * dilation[1] + 1)
    imgs = bm // (bh * bw)

    def descriptors(x, w):
        xv, wv = conv_tma_operands(x, w, (1, 1))
        return (TensorDescriptor.from_tensor(xv, [imgs, bh, bw, bk]), TensorDescriptor.from_tensor(wv, [bn, 1, 1, bk]),
                wv)  # and the weight itself, for its prefetch (conv2d_fprop.conv2d_tma_prefetch)

    tiles = triton.cdiv(nb, imgs) * triton.cdiv(oh, bh) * triton.cdiv(ow, bw) * triton.cdiv(ko, bn)
    s_on, s_ok, s_oh, s_ow = out.stride()
    head = [nb, h, wd, c, ko, oh, ow, r, s, s_on, s_oh, s_ow, padding[0], padding[1], dilation[0], dilation[1], s_ok]
    meta = dict(BM=bm, BN=bn, BK=bk, GROUP_M=cfg.group_m, SPLIT_K=split, BH=bh, BW=bw, PRECISION=_precision(x.dtype),
                WS=cfg.ws, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return Plan(codegen.load(CONV_TMA_FAMILY, signature), (tiles, 1, split), head,
                operand_strides(signature, operands, out.shape, 1), meta, (tiles, split, bm, bn), out.device,
                descriptors, tiles // triton.cdiv(ko, bn))


def conv2d_dgrad(grad_out: torch.Tensor, w: torch.Tensor, operands, signature: str, stride, padding, dilation,
                 out: torch.Tensor, config: DgradConfig | None = None,
                 stats: torch.Tensor | None = None) -> torch.Tensor:
    """out = epilogue(grad_input) for the forward conv2d(input, w, stride, padding, dilation), groups=1.

    grad_out is [N, K, OH, OW], w the forward weight [K, C, R, S], out the preallocated grad_input [N, C, H, W]:
    its H and W (the forward input's) settle what a strided conv's output size leaves open. Any strides.
    """
    key = plan_key("conv2d_dgrad", signature, tuple(stride), tuple(padding), tuple(dilation), config,
               options()["split_k"], grad_out, w, out, *operands)
    return cached_launch(
        key, lambda: _dgrad_plan(grad_out, w, operands, signature, stride, padding, dilation, out, config),
        (grad_out, w), out, operands, signature, 1, stats=stats)


def _dgrad_plan(grad_out, w, operands, signature, stride, padding, dilation, out, config) -> Plan | None:
    _check_inputs(grad_out, w, out)
    if grad_out.dim() != 4 or w.dim() != 4 or out.dim() != 4:
        raise NotImplementedError(f"conv2d dgrad takes 4-D tensors, got grad_out {tuple(grad_out.shape)}, "
                                  f"weight {tuple(w.shape)}, out {tuple(out.shape)}")
    nb, ko, oh, ow = grad_out.shape
    kw, c, r, s = w.shape
    h, wd = out.shape[2:]
    if out.shape[1] != c:
        raise NotImplementedError(f"conv2d dgrad supports groups=1 only (grad_input C={out.shape[1]}, weight C={c})")
    expect = tuple((size + 2 * p - d * (k - 1) - 1) // st + 1
                   for size, k, st, p, d in zip((h, wd), (r, s), stride, padding, dilation))
    if kw != ko or out.shape[0] != nb or (oh, ow) != expect:
        raise ValueError(f"conv2d dgrad shapes disagree: grad_out {tuple(grad_out.shape)}, weight {tuple(w.shape)}, "
                         f"grad_input {tuple(out.shape)} (expected grad_out spatial size {expect})")
    if out.numel() == 0:
        return None
    cfg = config or dgrad_config(DgradProblem(nb, c, ko, r, s, h, wd, stride[0], stride[1], w.element_size(),
                                              sm_count(w.device)))
    split = _split(cfg.split_k)
    phases = stride[0] * stride[1]
    tiles_m = triton.cdiv(nb * triton.cdiv(h, stride[0]) * triton.cdiv(wd, stride[1]), cfg.block_m)  # per phase
    tiles = tiles_m * triton.cdiv(c, cfg.block_n)
    s_on, s_oc, s_oh, s_ow = out.stride()
    if cfg.tma and dgrad_as_gemm(grad_out, w, stride, padding, out.stride()) is not None:  # a 1x1 dgrad
        return _tma_plan(lambda g, w: gemm_views(g, w.transpose(0, 1)), (grad_out, w), operands, signature, out, 1,
                         cfg, split, tiles, (h * wd, s_on, s_ow, s_oc))
    (gcd_h, inv_h), (gcd_w, inv_w) = tap_inverse(stride[0], dilation[0]), tap_inverse(stride[1], dilation[1])
    head = [nb, h, wd, c, ko, oh, ow, r, s, *grad_out.stride(), *w.stride(), s_on, s_oh, s_ow,
            stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1], gcd_h, gcd_w, inv_h, inv_w, s_oc]
    meta = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split,
                PRECISION=_precision(w.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return Plan(codegen.load(DGRAD_FAMILY, signature), (tiles, phases, split), head,
                operand_strides(signature, operands, out.shape, 1), meta,
                (tiles * phases, split, cfg.block_m, cfg.block_n), out.device,
                row_blocks=phases * tiles_m)
