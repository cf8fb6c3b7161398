"""Two 1x1 convs in one kernel: a bottleneck's tail conv and the next block's head conv, which reads its output.

    y = epilogue1(x @ W1)     stored: the next residual block's input, which other ops read too
    z = epilogue2(y @ W2)     y is not read back: each [BM, BN1] chunk of y, still in registers, is multiplied
                              into z's accumulator as soon as it is stored

Entry points: `conv2d_chain(x, w1, operands1, signature1, w2, operands2, signature2, y, z, config=None)`, reached
through resfuse.kernels (ops/chain.py calls it); `refusal(x, w1, w2)`, and for kernels/shortcut.py too
`unaligned(*tensors)`, `nhwc_dense(t)` and `pixel_rows(t)`; `ChainConfig`
with `SPACE` and `default_config` (the tuning space, tuning/space.py). Both convs are 1x1, stride 1, unpadded,
groups 1, on a channels_last fp16/bf16 input: GEMMs over the N*H*W pixel rows, every operand read through TMA
descriptors (a full epilogue operand too, where it is laid out like the output). The kernel is persistent: each
program walks row blocks of BM pixels. It holds a block's whole x rows ([BM, K1]) and z accumulator ([BM, N2]),
so K1 and N2 are powers of two of at most 256 (a descriptor box's limit); N1 is walked in chunks of BN1. Its
source is generated per pair of epilogues (the second's operands and temporaries named `e2_...`).

Measured on an H100 (bench/chain_proto.py, BENCHMARKS.md): 1.45x over the two separately tuned convs on
ResNet-50's layer 1 (64 > 256 > 64), even on layer 2 (128 > 512 > 128), 0.47x on layer 3 (256 > 1024 > 256),
where the [BM, K1] rows and the [BM, N2] accumulator no longer leave room for wide tiles. The tuner decides.
"""
from __future__ import annotations

import dataclasses
import textwrap

import torch
import triton

from .. import epilogue as epi
from . import codegen, options
from .epilogue_source import triton_body, triton_params
from .plan import (Launcher, descriptor_operands, launch_or_refuse, operand_args, operand_strides, pdl_meta,
                   plan_key, sm_count)


@dataclasses.dataclass(frozen=True)
class ChainProblem:
    m: int  # pixel rows, N*H*W
    k1: int  # x's channels
    n1: int  # y's
    n2: int  # z's
    dtype_bytes: int
    sms: int


@dataclasses.dataclass(frozen=True)
class ChainConfig:
    block_m: int = 64
    block_n1: int = 128
    num_warps: int = 4
    num_stages: int = 2
    persistent: int = 1  # programs an SM

    def check(self, p: ChainProblem) -> bool:
        # registers: the z accumulator, a y chunk and half the x rows per thread, as the probe's sweep bore out
        # (bench/results/chain_proto_sweep_twentyfifth_h100.log: wider tiles failed on shared memory or spilled)
        regs = self.block_m * (p.n2 + self.block_n1 + p.k1 // 2) <= 192 * 32 * self.num_warps
        return (p.n1 % self.block_n1 == 0 and _pow2(self.block_m) and _pow2(self.block_n1) and regs
                and self.num_warps in (4, 8) and self.num_stages in (1, 2) and self.persistent >= 1
                and self.staged_bytes(p) <= SMEM_BYTES)

    def staged_bytes(self, p: ChainProblem) -> int:
        """Shared memory that a pipelined config takes at least: from two stages on, Triton's pipeliner keeps every
        chunk of both weights in each stage, and 48 KB more besides (`python bench/chain_smem.py`, compiled for
        sm_90: ResNet-50's layer-2 pair, 128 > 512 > 128, takes 639,672 bytes at two stages, of which 524,288 are
        the weights twice, against 50,176 at one stage; the extra over the weights was 59-148 KB on the 10 configs
        measured). One stage is not bounded here (16-83 KB there). A config that passes `check` and still does not
        fit fails as it loads: the tuner drops it, and `conv2d_chain` refuses it at run time."""
        if self.num_stages < 2:
            return 0
        return self.num_stages * p.dtype_bytes * p.n1 * (p.k1 + p.n2) + 48 * 1024


SMEM_BYTES = 232448  # shared memory a block of an H100 may take (227 KB)
# every config of this space measured on ResNet-50's pairs (run 2 of the probe); the tuner's fast level takes it all
SPACE = {"block_m": (64,), "block_n1": (64, 128), "num_warps": (4,), "num_stages": (1, 2), "persistent": (1, 2)}


def default_config(p: ChainProblem) -> ChainConfig | None:
    """The probe's winner on layer 1 at both batches (BM 64, BN1 128, 4 warps, 2 stages); BN1 smaller where N1
    is not a multiple of 128 (the largest power of two that divides it); then one stage, then BN1 64, where that
    does not pass `check`. None where nothing does: `refusal` then keeps the two convs apart."""
    bn1 = min(128, p.n1 & -p.n1)
    tries = (ChainConfig(block_n1=bn1), ChainConfig(block_n1=bn1, num_stages=1),
             ChainConfig(block_n1=min(bn1, 64), num_stages=1))
    return next((cfg for cfg in tries if cfg.check(p)), None)


def _pow2(n: int) -> bool:
    return 16 <= n <= 256 and n & (n - 1) == 0


def refusal(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> str | None:
    """Why the chain kernel cannot run these convs (None: it can); the fused outputs come from conv_output."""
    if x.dtype not in (torch.float16, torch.bfloat16) or w1.dtype != x.dtype or w2.dtype != x.dtype:
        return f"the chain kernel takes fp16/bf16 inputs, got {x.dtype}, {w1.dtype}, {w2.dtype}"
    if x.dim() != 4 or w1.dim() != 4 or w2.dim() != 4 or w1.shape[2:] != (1, 1) or w2.shape[2:] != (1, 1):
        return "the chain kernel takes two 1x1 convs"
    k1, n1, n2 = x.shape[1], w1.shape[0], w2.shape[0]
    if w1.shape[1] != k1 or w2.shape[1] != n1:
        return "a grouped conv in the chain"
    if not (_pow2(k1) and _pow2(n2)) or n1 % 16 or n1 > 1024:
        return (f"channels {k1} > {n1} > {n2}: the chain kernel takes powers of two from 16 to 256 for the first "
                "and last, a multiple of 16 up to 1024 between")
    if not nhwc_dense(x) or any(w.reshape(w.shape[0], -1).stride(1) != 1 for w in (w1, w2)):
        return "the chain kernel takes a channels_last input and dense 1x1 weights"
    if default_config(ChainProblem(0, k1, n1, n2, x.element_size(), 1)) is None:
        return f"channels {k1} > {n1} > {n2}: no config of the chain kernel fits its registers and shared memory"
    return None


def nhwc_dense(t: torch.Tensor) -> bool:
    """Is the [N, C, H, W] t a dense channels_last tensor, so that its [N*H*W, C] rows are a view? From the
    strides alone (a graph's fake tensor may have a symbolic batch; a dim of size 1 has no layout)."""
    _, c, h, w = t.shape
    dense = (h * w * c, 1, w * c, c)
    return all(s == e for d, (s, e) in enumerate(zip(t.stride(), dense)) if d == 0 or t.shape[d] != 1)


def unaligned(*tensors: torch.Tensor) -> str | None:
    """Why tensor descriptors cannot read these (real) tensors: a base that is not 16-byte aligned."""
    return "a tensor descriptor needs 16-byte aligned tensors" if any(t.data_ptr() % 16 for t in tensors) else None


def pixel_rows(t: torch.Tensor) -> torch.Tensor:
    """A channels_last [N, C, H, W] tensor as its [N*H*W, C] matrix (a view)."""
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])


def source(signature1: str, signature2: str, slots1: tuple, slots2: tuple) -> str:
    tree1, tree2 = epi.parse(signature1), epi.parse(signature2)
    params = ["a_desc", "w1_desc", "w2_desc", "y_desc", "z_desc", "M", "P", "TILES",
              *triton_params(tree1, "e1_"), *triton_params(tree2, "e2_"),
              *[f"{c}: tl.constexpr" for c in ("K1", "N1", "N2", "BM", "BN1", "PRECISION", "PDL")]]
    body1 = triton_body(tree1, "y_val", slots1, "e1_", out_ty="a.dtype")
    body2 = triton_body(tree2, "z_val", slots2, "e2_", out_ty="a.dtype")

    param_lines = "\n".join(f"    {p}," for p in params)

    return f'''"""Generated by resfuse.kernels.chain (template version {codegen.TEMPLATE_VERSION}); do not edit.

Two 1x1 convs. Epilogue 1: {signature1}. Epilogue 2: {signature2}
"""
import triton
import triton.language as tl

from resfuse.kernels.activations import {", ".join(codegen.HELPERS)}
from resfuse.kernels.tiles import dependent_launch, mma


@triton.jit
def resfuse_conv2d_chain(
{param_lines}
):
    dependent_launch(PDL)  # programmatic dependent launch: wait for the producer
    for tile in tl.range(tl.program_id(0), TILES, tl.num_programs(0)):
        row0 = tile * BM
        rows = row0 + tl.arange(0, BM)
        row_ok = rows < M  # past M, a box reads zeros and a store is clipped
        s_idx = rows // P
        p_idx = rows % P
        a = a_desc.load([row0, 0])  # x's rows, read once for every chunk of y
        acc2 = tl.full([BM, N2], 0.0, tl.float32)
        for col0 in tl.static_range(0, N1, BN1):
            acc = mma(a, tl.trans(w1_desc.load([col0, 0])), tl.full([BM, BN1], 0.0, tl.float32), PRECISION)
            offs_c = col0 + tl.arange(0, BN1)
            mask_c = offs_c < N1
            mask = row_ok[:, None] & mask_c[None, :]
            # epilogue 1: {signature1}
{textwrap.indent(body1, " " * 12)}
            y_chunk = y_val.to(a.dtype)
            y_desc.store([row0, col0], y_chunk)
            acc2 = mma(y_chunk, tl.trans(w2_desc.load([0, col0])), acc2, PRECISION)
        acc = acc2
        col0 = 0
        offs_c = tl.arange(0, N2)
        mask_c = offs_c < N2
        mask = row_ok[:, None] & mask_c[None, :]
        # epilogue 2: {signature2}
{textwrap.indent(body2, " " * 8)}
        z_desc.store([row0, 0], z_val.to(a.dtype))
'''


class ChainPlan:
    """What a launch needs that depends only on shapes, strides, dtypes and the config (plan.Plan's role)."""

    def __init__(self, x, w1, w2, operands1, signature1, operands2, signature2, y, z, cfg: ChainConfig):
        m, k1 = x.shape[0] * x.shape[2] * x.shape[3], x.shape[1]
        n1, n2 = w1.shape[0], w2.shape[0]
        bm, bn1 = cfg.block_m, cfg.block_n1
        self.boxes = ([bm, k1], [bn1, k1], [n2, bn1], [bm, bn1], [bm, n2])
        self.strides1 = operand_strides(signature1, operands1, y.shape, 1)
        self.strides2 = operand_strides(signature2, operands2, z.shape, 1)
        self.slots1 = descriptor_operands(signature1, operands1, y.shape, 1, m, n1, [bm, bn1])
        self.slots2 = descriptor_operands(signature2, operands2, z.shape, 1, m, n2, [bm, n2])
        self.kernel = codegen.load_source(
            "conv2d_chain", f"{signature1};{signature2}|tma{sorted(self.slots1)};{sorted(self.slots2)}",
            lambda: source(signature1, signature2, tuple(sorted(self.slots1)), tuple(sorted(self.slots2))))
        tiles = triton.cdiv(m, bm)
        self.grid = (min(tiles, cfg.persistent * sm_count(x.device)),)
        self.head = [m, x.shape[2] * x.shape[3], tiles]
        upcast = x.dtype == torch.bfloat16 and options()["interpret"]  # see tiles.mma
        self.config = cfg
        self.meta = dict(K1=k1, N1=n1, N2=n2, BM=bm, BN1=bn1, PRECISION="upcast" if upcast else "ieee",
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_meta(x.device))
        self.launcher = Launcher(self.kernel, self.grid, self.meta)

    def launch(self, x, w1, w2, operands1, signature1, operands2, signature2, y, z):
        from triton.tools.tensor_descriptor import TensorDescriptor

        mats = (pixel_rows(x), w1.reshape(w1.shape[0], -1), w2.reshape(w2.shape[0], -1), pixel_rows(y),
                pixel_rows(z))
        descs = [TensorDescriptor.from_tensor(t, box) for t, box in zip(mats, self.boxes)]
        ops1 = operand_args(operands1, self.strides1, self.slots1, signature1, y.shape, 1)
        ops2 = operand_args(operands2, self.strides2, self.slots2, signature2, z.shape, 1)
        self.launcher(*descs, *self.head, *ops1, *ops2)


_PLANS: dict = {}  # plan_key -> ChainPlan, or the reason its config failed to load (conv2d_chain)


def conv2d_chain(x, w1, operands1, signature1: str, w2, operands2, signature2: str, y: torch.Tensor,
                 z: torch.Tensor, config: ChainConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y = epilogue1(conv1x1(x, w1)), z = epilogue2(conv1x1(y, w2)), written into the preallocated channels_last
    y and z (ops/chain.py's outputs)."""
    key = plan_key("conv2d_chain", signature1, signature2, config, x, w1, w2, y, z, *operands1, *operands2)
    plan = _PLANS.get(key)
    if plan is None:
        why = refusal(x, w1, w2) or unaligned(x, w1, w2, y, z)
        if why is None and not (nhwc_dense(y) and nhwc_dense(z)):
            why = "the chain kernel writes channels_last outputs"
        if why:
            raise NotImplementedError(why)
        cfg = config or default_config(ChainProblem(pixel_rows(x).shape[0], x.shape[1], w1.shape[0], w2.shape[0],
                                                    x.element_size(), sm_count(x.device)))
        plan = _PLANS[key] = ChainPlan(x, w1, w2, operands1, signature1, operands2, signature2, y, z, cfg)
    if y.numel():
        launch_or_refuse(_PLANS, key, "chain",
                         lambda p: p.launch(x, w1, w2, operands1, signature1, operands2, signature2, y, z))
    return y, z
