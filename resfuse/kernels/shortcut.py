"""A residual block's last 1x1 conv and its shortcut conv in one kernel: the shortcut's output is never written.

    r = epilogue2(conv1x1(x, w2, stride))        the shortcut (a downsampling block's conv + batch norm)
    z = epilogue1(conv1x1(y, w1), residual=r)    the main path's last conv, which adds r (FuseAddToOutput's add)

Entry points: `conv2d_shortcut(y, w1, operands1, signature1, slot, x, w2, operands2, signature2, stride, z,
config=None)`, reached through resfuse.kernels (ops/shortcut.py calls it); `refusal(y, w1, x, w2, stride)`;
`ShortcutConfig` with `SPACE` and `default_config` (the tuning space, tuning/space.py). Unfused, r is written
and read back by the main conv: at ResNet-50's first block, bs32, 51 MB each way.

Each program first reduces its tile of the shortcut conv: x is sampled at the stride through pointer loads, and
w2 is read through a tensor descriptor. Reading x through a descriptor at stride 1 measured slower: 57 against
47 us on ResNet-50's first block at bs32, where each reduction is one block of 64 channels. Then, in one of two
forms:
  - two epilogues: it applies the shortcut's epilogue and rounds r to the output dtype, as the store would have;
    then the main conv's reduction (y and w1 through descriptors) and its epilogue, which reads r from registers
    (operand `slot` of signature1; operands1 has a stand-in there, never read);
  - the sum (slot and signature2 None): the main conv's reduction goes on in the same accumulator, then
    epilogue1 alone. ops/shortcut.py folds both batch norms into the weights for it, and with no r held, the
    registers take 128 x 256 tiles.

Both convs are 1x1 and unpadded, groups 1. The main one is stride 1 on a dense channels_last fp16/bf16 y; the
shortcut has any stride, on x of any layout. Channels are multiples of 8 (a descriptor's rows are 16-byte aligned).
"""
from __future__ import annotations

import dataclasses
import textwrap

import torch
import triton

from .. import epilogue as epi
from . import codegen, options
from .epilogue_source import triton_body, triton_params
from .chain import nhwc_dense, pixel_rows, unaligned
from .plan import (Launcher, descriptor_output, launch_or_refuse, operand_args, operand_strides, pdl_meta,
                   plan_key, sm_count)


@dataclasses.dataclass(frozen=True)
class ShortcutProblem:
    m: int  # output pixel rows, N*OH*OW
    k1: int  # y's channels (the main conv's input)
    k2: int  # x's (the shortcut's input)
    n: int  # output channels
    dtype_bytes: int
    sms: int
    foldable: bool = False  # the op can run as the sum form (ops/shortcut.py's summed_tree): its configs fold


@dataclasses.dataclass(frozen=True)
class ShortcutConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma_store: bool = False  # the output written by bulk stores, where descriptor_output accepts it
    fold: bool = False  # the sum form: both batch norms folded into the weights, one accumulator (ops/shortcut.py)

    def check(self, p: ShortcutProblem) -> bool:
        # registers: the fp32 accumulator, and unfolded the 16-bit residual held through the main conv's reduction;
        # folded, only the wide tiles that the freed registers are for
        tile = self.block_m * self.block_n
        if self.fold:
            regs = min(self.block_m, self.block_n) >= 128 and tile <= 128 * 32 * self.num_warps
        else:
            regs = max(self.block_m, self.block_n) <= 128 and tile * 3 // 2 <= 128 * 32 * self.num_warps
        smem = self.num_stages * (self.block_m + self.block_n) * self.block_k * p.dtype_bytes
        return (min(self.block_m, self.block_n, self.block_k) >= 16 and smem <= 220 * 1024 and regs
                and self.num_warps in (4, 8) and self.fold == p.foldable)


# (two stages measured no faster on ResNet-50's first block, whose reductions are one block of 64 channels); an op
# gets the configs of one form: the sum form's where it folds (it won every block of ResNet-50 at bs32 and bs256, run
# 7), else the two-epilogue form's
SPACE = {"block_m": (64, 128, 256), "block_n": (64, 128, 256), "block_k": (64,), "group_m": (8,), "num_warps": (4, 8),
         "num_stages": (3, 4), "tma_store": (False, True), "fold": (False, True)}


def default_config(p: ShortcutProblem) -> ShortcutConfig:
    """The sum form where the op folds: 128 x 128 tiles of 4 warps, bulk stores, what the tuner kept on three of
    ResNet-50's four blocks at bs32 (bench/results/ab_shortcut_sumform_rn50_bs32_bs256_run7_thirtysecond_h100.log);
    otherwise 64 x 128 of 4 warps (64 x 64 for fewer channels), as it kept for the two-epilogue form (run 2). Under
    the interpreter (one SM) small tiles, so that edge tiles are exercised."""
    if p.sms == 1:
        return ShortcutConfig(32, 32, 32, 8, 4, 2, fold=p.foldable)
    if p.foldable:
        return ShortcutConfig(128, 128, 64, 8, 4, 3, tma_store=True, fold=True)
    return ShortcutConfig(64, 128 if p.n >= 128 else 64, 64, 8, 4, 4)


def refusal(y: torch.Tensor, w1: torch.Tensor, x: torch.Tensor, w2: torch.Tensor, stride) -> str | None:
    """Why this kernel cannot run these convs (None: it can)."""
    if y.dtype not in (torch.float16, torch.bfloat16) or any(t.dtype != y.dtype for t in (w1, x, w2)):
        return f"the shortcut kernel takes fp16/bf16 inputs, got {y.dtype}, {w1.dtype}, {x.dtype}, {w2.dtype}"
    if any(t.dim() != 4 for t in (y, w1, x, w2)) or w1.shape[2:] != (1, 1) or w2.shape[2:] != (1, 1):
        return "the shortcut kernel takes two 1x1 convs"
    if w1.shape[1] != y.shape[1] or w2.shape[1] != x.shape[1]:
        return "a grouped conv"
    if w1.shape[0] != w2.shape[0]:
        return "the two convs' output channels differ"
    if any(c % 8 for c in (y.shape[1], x.shape[1], w1.shape[0])):
        return "channels that are not multiples of 8"
    out_hw = [(d - 1) // s + 1 for d, s in zip(x.shape[2:], stride)]
    if x.shape[0] != y.shape[0] or out_hw != list(y.shape[2:]):
        return "the shortcut's output is not shaped like the main conv's"
    if not nhwc_dense(y) or any(w.reshape(w.shape[0], -1).stride(1) != 1 for w in (w1, w2)):
        return "the shortcut kernel takes a channels_last input and dense 1x1 weights"
    return None


def source(signature1: str, signature2: str | None, slot: int | None) -> str:
    """The kernel's source; with signature2 None, the sum form: both reductions into one accumulator, then
    epilogue 1 alone (ops/shortcut.py folds both batch norms into the weights for it)."""
    tree1 = epi.parse(signature1)
    tree2 = None if signature2 is None else epi.parse(signature2)
    params = ["y_desc", "w1_desc", "x", "w2_desc", "out", "M", "N", "P", "OW", "s_xn", "s_xh", "s_xw", "s_xc",
              *triton_params(tree1, "e1_"), *([] if tree2 is None else triton_params(tree2, "e2_")),
              *[f"{c}: tl.constexpr" for c in ("K1", "K2", "BM", "BN", "BK", "GROUP_M", "OUT_TMA", "PRECISION",
                                                  "PDL")]]
    body1 = triton_body(tree1, "z_val", prefix="e1_", given=None if tree2 is None else {slot: "r.to(tl.float32)"},
                            out_ty="y_desc.dtype")
    between = "    # the sum form: the main conv's reduction goes on in the same accumulator\n"
    if tree2 is not None:
        between = f"""    # epilogue 2: {signature2}
{textwrap.indent(triton_body(tree2, "r_val", prefix="e2_", out_ty="y_desc.dtype"), " " * 4)}
    r = r_val.to(y_desc.dtype)  # rounded as the shortcut's output would have been stored (the inputs' dtype)
    acc = tl.full([BM, BN], 0.0, tl.float32)
"""
    what = (f"Epilogue 1: {signature1} (operand {slot}: the residual). Epilogue 2: {signature2}" if tree2 is not None
            else f"Their sum, then the epilogue: {signature1}")
    param_lines = "\n".join(f"    {p}," for p in params)
    return f'''"""Generated by resfuse.kernels.shortcut (template version {codegen.TEMPLATE_VERSION}); do not edit.

A 1x1 conv and its residual's 1x1 conv. {what}
"""
import triton
import triton.language as tl

from resfuse.kernels.activations import {", ".join(codegen.HELPERS)}
from resfuse.kernels.tiles import cdiv, dependent_launch, mma, swizzle_tile


@triton.jit
def resfuse_conv2d_shortcut(
{param_lines}
):
    dependent_launch(PDL)  # programmatic dependent launch: wait for the producer
    tile_m, tile_n = swizzle_tile(tl.program_id(0), cdiv(M, BM), cdiv(N, BN), GROUP_M)
    rows = tile_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    s_idx = rows // P
    p_idx = rows % P
    offs_c = tile_n * BN + tl.arange(0, BN)
    mask_c = offs_c < N
    mask = row_ok[:, None] & mask_c[None, :]
    # the shortcut: x's pixel under each output row, at the conv's stride (folded into s_xh and s_xw)
    x_rows = s_idx.to(tl.int64) * s_xn + (p_idx // OW) * s_xh + (p_idx % OW) * s_xw
    offs_k = tl.arange(0, BK)
    acc = tl.full([BM, BN], 0.0, tl.float32)
    for k0 in range(0, K2, BK):
        k_ok = k0 + offs_k < K2
        a = tl.load(x + x_rows[:, None] + (k0 + offs_k)[None, :] * s_xc, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = mma(a, tl.trans(w2_desc.load([tile_n * BN, k0])), acc, PRECISION)
{between}    for k0 in range(0, K1, BK):
        acc = mma(y_desc.load([tile_m * BM, k0]), tl.trans(w1_desc.load([tile_n * BN, k0])), acc, PRECISION)
    # epilogue 1: {signature1}
{textwrap.indent(body1, " " * 4)}
    if OUT_TMA:  # one bulk store, clipped at the matrix's edges
        out.store([tile_m * BM, tile_n * BN], z_val.to(y_desc.dtype))
    else:
        tl.store(out + rows.to(tl.int64)[:, None] * N + offs_c[None, :], z_val.to(y_desc.dtype), mask=mask)
'''


class ShortcutPlan:
    """What a launch needs that depends only on shapes, strides, dtypes and the config (plan.Plan's role)."""

    def __init__(self, y, w1, operands1, signature1, slot, x, w2, operands2, signature2, stride, z,
                 cfg: ShortcutConfig):
        m, n = pixel_rows(z).shape
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        self.boxes = ([bm, bk], [bn, bk], [bn, bk])
        smem = cfg.num_stages * (bm + bn) * bk * y.element_size()
        self.out_box = descriptor_output(z, m, n, n, [bm, bn], smem) if cfg.tma_store else None
        self.strides1 = operand_strides(signature1, operands1, z.shape, 1)
        self.strides2 = [] if signature2 is None else operand_strides(signature2, operands2, z.shape, 1)
        self.kernel = codegen.load_source("conv2d_shortcut", f"{signature1};{signature2}|{slot}",
                                          lambda: source(signature1, signature2, slot))
        self.grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        s_n, s_c, s_h, s_w = x.stride()
        self.head = [m, n, z.shape[2] * z.shape[3], z.shape[3], s_n, s_h * stride[0], s_w * stride[1], s_c]
        upcast = y.dtype == torch.bfloat16 and options()["interpret"]  # see tiles.mma
        self.meta = dict(K1=y.shape[1], K2=x.shape[1], BM=bm, BN=bn, BK=bk, GROUP_M=cfg.group_m,
                         OUT_TMA=self.out_box is not None,
                         PRECISION="upcast" if upcast else "ieee", num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, **pdl_meta(y.device))
        self.launcher = Launcher(self.kernel, self.grid, self.meta)
        self.config = cfg

    def launch(self, y, w1, operands1, signature1, x, w2, operands2, signature2, z):
        from triton.tools.tensor_descriptor import TensorDescriptor

        mats = (pixel_rows(y), w1.reshape(w1.shape[0], -1), w2.reshape(w2.shape[0], -1))
        descs = [TensorDescriptor.from_tensor(t, box) for t, box in zip(mats, self.boxes)]
        ops1 = operand_args(operands1, self.strides1, {}, signature1, z.shape, 1)
        ops2 = [] if signature2 is None else operand_args(operands2, self.strides2, {}, signature2, z.shape, 1)
        out = TensorDescriptor(z, *self.out_box) if self.out_box else z
        self.launcher(descs[0], descs[1], x, descs[2], out, *self.head, *ops1, *ops2)


_PLANS: dict = {}  # plan_key -> ShortcutPlan, or the reason its config failed to load


def conv2d_shortcut(y, w1, operands1, signature1: str, slot: int | None, x, w2, operands2, signature2: str | None,
                    stride, z: torch.Tensor, config: ShortcutConfig | None = None) -> torch.Tensor:
    """z = epilogue1(conv1x1(y, w1)) with its operand `slot` the residual epilogue2(conv1x1(x, w2, stride)),
    written into the preallocated channels_last z (ops/shortcut.py's output). operands1 has no tensor at `slot`.
    With slot and signature2 None (and no operands2), the sum form: z = epilogue1(conv1x1(y, w1) + conv1x1(x, w2,
    stride)), the config's fold or not."""
    if slot is not None:
        operands1 = [*operands1[:slot], z, *operands1[slot:]]  # the stand-in: a tensor laid out as the residual
    key = plan_key("conv2d_shortcut", signature1, slot, signature2, tuple(stride), config, y, w1, x, w2, z,
                   *operands1, *operands2)
    plan = _PLANS.get(key)
    if plan is None:
        why = refusal(y, w1, x, w2, stride) or unaligned(y, w1, w2)
        if why is None and not nhwc_dense(z):
            why = "the shortcut kernel writes a channels_last output"
        if why:
            raise NotImplementedError(why)
        cfg = config or default_config(ShortcutProblem(pixel_rows(z).shape[0], y.shape[1], x.shape[1],
                                                       w1.shape[0], y.element_size(), sm_count(y.device)))
        plan = _PLANS[key] = ShortcutPlan(y, w1, operands1, signature1, slot, x, w2, operands2, signature2, stride,
                                          z, cfg)
    if z.numel():
        launch_or_refuse(_PLANS, key, "shortcut",
                         lambda p: p.launch(y, w1, operands1, signature1, x, w2, operands2, signature2, z))
    return z
