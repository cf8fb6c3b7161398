"""Batch-norm family: training-mode batch norm forward with a fused epilogue (the bn -> add -> relu tail of every
ResNet bottleneck, and OneFlow's "normalization" producer with add-to-output).

Entry points: `batch_norm_train(x, weight, bias, running_mean, running_var, operands, signature, momentum, eps,
out=None, config=None, sums=None) -> (y, save_mean, save_invstd, new_running_mean, new_running_var)`, and
`batch_norm_stats(...)`, passes 1 and 2 alone (a shortcut's batch norm that another's epilogue applies), reached
through resfuse.kernels. It computes what aten._native_batch_norm_legit_functional(x, weight, bias, running_mean,
running_var, True, momentum, eps) does, then the epilogue tree `signature` with `acc` = the affine output in
fp32, and writes y in x's dtype. Also here: `FAMILY` (what codegen wraps), `BnConfig`, `default_config`.

x is [N, C, *] (channel dim 1) at any strides that give an [S, P, C] view (epilogue.rows3): contiguous,
channels_last, [N, C]. Three passes over memory, one kernel each:
  1. `bn_partials_kernel`, grid (row splits, channel blocks): each program walks its rows tile by tile,
     summing d and d^2 per lane, with d = x - a pivot near the mean (so a mean far from 0 costs no
     precision); it writes one (mean, M2) per split and channel to an fp32 workspace.
  2. `bn_finalize_kernel`, grid (channel blocks): merges the splits with the k-group form of Chan's formula,
     M2 = sum M2_i + sum n_i (mean_i - mean)^2, in fixed order, so results are bit-identical run to run (no
     atomics); writes save_mean, save_invstd, the new running stats and the per-channel scale and shift.
  3. the generated kernel (codegen.py, family "batch_norm"): acc = (x - mean) * scale + shift, the epilogue, y.
Given `sums` (fp32 [2, C]: sum(x), sum(x * x) per channel, which cuDNN's conv computed in its epilogue:
ops/training.py's conv2d_stats, put in graphs by passes/conv_stats.py), passes 1 and 2 are one small kernel,
`bn_finalize_sums_kernel`: the mean and M2 from the sums, and only for channels where M2 = sum(x^2) - sum(x)^2 / n cancelled too many bits, one exact pass over x.

Return conventions: y has x's dtype, shape and strides (`out` if given, else torch.empty_like(x), made contiguous
where x's strides are no [S, P, C] view, e.g. H and W swapped; such an x is read through a copy); save_mean and
save_invstd are fp32 always (what CUDA returns; aten on CPU returns the running stats' dtype for half inputs);
the new running stats keep the running stats' own dtype, and are None when running_mean / running_var are None
(aten's _native_batch_norm_legit.no_stats then returns no running stats at all). weight / bias None mean 1 / 0.
As in aten, N*H*W = 1 gives a NaN running_var (the unbiased variance divides 0 by 0), and an empty x raises.
A channel holding NaN or Inf gives NaN y, save_invstd and running_var like eager; its save_mean is NaN where
aten on CPU (a plain sum) gives +-Inf; CUDA's Welford gives NaN too.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import epilogue as epi
from . import codegen
from .codegen import Family
from .activations import sum_rows
from .elementwise import ewise_mainloop
from .plan import Plan, launch, operand_strides, pdl_meta, plan_key, sm_count
from .tiles import cdiv, dependent_launch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- kernels -------------------------------------------------------------------------------------------
@triton.jit
def _row_offsets(rows, RPS, s_s, s_p):
    """Element offsets of [S, P, C] rows given as flat indices over S * P."""
    return (rows // RPS) * s_s + (rows % RPS) * s_p


@triton.jit
def bn_partials_kernel(x, ws, M, C, RPS, s_xs, s_xp, s_xc, TILES_PER_SPLIT, SPLITS,
                       BP: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    """(mean, M2) of one split of rows for BC channels, into ws[2C + {0, SPLITS*C} + split*C + c]."""
    dependent_launch(PDL)
    pid_r = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    ok_c = offs_c < C
    cols = offs_c * s_xc
    t_lo = pid_r * TILES_PER_SPLIT
    t_hi = tl.minimum(t_lo + TILES_PER_SPLIT, cdiv(M, BP))
    # Every value is taken relative to a pivot near the channel's mean: the sums then add numbers of the spread's
    # size, not of the mean's, and sum(d^2) - sum(d)^2 / n cancels little. fp32 inputs take the mean of the split's
    # first tile (within a fraction of a deviation); a single row, a few deviations off, cost fp32 variances up
    # to 11 ulp (tests/kernels/test_batch_norm.py). fp16/bf16 inputs take the split's first row: that error is far
    # below their own rounding, and the tile's reduction before the loop cost 0.15 ms of a ResNet-50 bs256 step
    # on an H100 (BENCHMARKS.md, seventeenth session). The loop only loads and adds into per-lane registers
    # (a tile's reduction per step left the loads latency-bound); the lanes are summed once at the end.
    # Two tiles a step, both loads issued before either is used: Triton does not pipeline a loop whose loads
    # feed no dot, and one tile in flight a program took 2.43 ms of a ResNet-50 bs256 step on an H100, two
    # 2.21 (bench/bn_order.py).
    row_hi = tl.minimum(t_hi * BP, M)
    if x.dtype.element_ty == tl.float32:
        rows0 = t_lo * BP + tl.arange(0, BP)
        ok0 = (rows0 < row_hi)[:, None] & ok_c[None, :]
        first = tl.load(x + _row_offsets(rows0, RPS, s_xs, s_xp)[:, None] + cols[None, :], mask=ok0, other=0.0)
        pivot = sum_rows(tl.where(ok0, first, 0.0)) / tl.minimum(row_hi - t_lo * BP, BP).to(tl.float32)
    else:
        pivot = tl.load(x + _row_offsets(t_lo * BP, RPS, s_xs, s_xp) + cols, mask=ok_c, other=0.0).to(tl.float32)
    s1 = tl.full([BP, BC], 0.0, dtype=tl.float32)
    s2 = tl.full([BP, BC], 0.0, dtype=tl.float32)
    for t in range(t_lo, t_hi, 2):
        rows_a = t * BP + tl.arange(0, BP)
        rows_b = rows_a + BP
        ok_a = (rows_a < row_hi)[:, None] & ok_c[None, :]
        ok_b = (rows_b < row_hi)[:, None] & ok_c[None, :]
        va = tl.load(x + _row_offsets(rows_a, RPS, s_xs, s_xp)[:, None] + cols[None, :], mask=ok_a, other=0.0)
        vb = tl.load(x + _row_offsets(rows_b, RPS, s_xs, s_xp)[:, None] + cols[None, :], mask=ok_b, other=0.0)
        da = tl.where(ok_a, va.to(tl.float32) - pivot[None, :], 0.0)
        db = tl.where(ok_b, vb.to(tl.float32) - pivot[None, :], 0.0)
        s1 += da + db
        s2 += da * da + db * db
    n = (row_hi - t_lo * BP).to(tl.float32)
    sum1 = sum_rows(s1)
    mean = sum1 / n
    m2 = tl.maximum(sum_rows(s2) - sum1 * mean, 0.0)
    out = ws + 2 * C + pid_r * C + offs_c
    tl.store(out, pivot + mean, mask=ok_c)
    tl.store(out + SPLITS * C, m2, mask=ok_c)


@triton.jit
def bn_finalize_kernel(ws, save_mean, save_invstd, w, b, rm, rv, rm_out, rv_out,
                       M, C, SPLITS, ROWS_PER_SPLIT, momentum, eps,
                       BC: tl.constexpr, BR: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                       HAS_RUNNING: tl.constexpr, PDL: tl.constexpr):
    """Merge the splits' (mean, M2) for BC channels; write the statistics and ws[0:C] = scale, ws[C:2C] = shift."""
    dependent_launch(PDL)
    offs_c = tl.program_id(0) * BC + tl.arange(0, BC)
    ok_c = offs_c < C
    part = ws + 2 * C
    pivot = tl.load(part + offs_c, mask=ok_c, other=0.0)  # split 0's mean, again so sums stay small
    # pass 1: the count-weighted mean of the split means
    acc = tl.full([BR, BC], 0.0, dtype=tl.float32)
    for r0 in range(0, SPLITS, BR):
        r = r0 + tl.arange(0, BR)
        ok = (r < SPLITS)[:, None] & ok_c[None, :]
        n_r = tl.minimum(M - r * ROWS_PER_SPLIT, ROWS_PER_SPLIT).to(tl.float32)
        mean_r = tl.load(part + r[:, None] * C + offs_c[None, :], mask=ok, other=0.0)
        acc += tl.where(ok, n_r[:, None] * (mean_r - pivot[None, :]), 0.0)
    shift_mean = sum_rows(acc) / M
    # pass 2: M2 = sum M2_i + sum n_i (mean_i - mean)^2
    acc = tl.full([BR, BC], 0.0, dtype=tl.float32)
    for r0 in range(0, SPLITS, BR):
        r = r0 + tl.arange(0, BR)
        ok = (r < SPLITS)[:, None] & ok_c[None, :]
        n_r = tl.minimum(M - r * ROWS_PER_SPLIT, ROWS_PER_SPLIT).to(tl.float32)
        at = part + r[:, None] * C + offs_c[None, :]
        dev = tl.load(at, mask=ok, other=0.0) - pivot[None, :] - shift_mean[None, :]
        acc += tl.where(ok, tl.load(at + SPLITS * C, mask=ok, other=0.0) + n_r[:, None] * dev * dev, 0.0)
    _finish_stats(pivot + shift_mean, sum_rows(acc), offs_c, ok_c, ws, save_mean, save_invstd, w, b, rm, rv, rm_out,
                  rv_out, M, C, momentum, eps, BC, HAS_W, HAS_B, HAS_RUNNING)


RECOMPUTE_PAST = tl.constexpr(64.0)  # sum(x^2) / M2 past 64 (mean^2 > 63 variances): fp32 sums keep too few bits


@triton.jit
def bn_finalize_sums_kernel(sums, x, ws, save_mean, save_invstd, w, b, rm, rv, rm_out, rv_out,
                            M, C, RPS, s_xs, s_xp, s_xc, momentum, eps,
                            BP: tl.constexpr, BC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                            HAS_RUNNING: tl.constexpr, PDL: tl.constexpr):
    """bn_finalize_kernel from given per-channel fp32 sums[0:C] = sum(x), sums[C:2C] = sum(x^2) (a conv's epilogue
    computed them) instead of the partials pass. M2 = sum(x^2) - sum(x)^2 / M cancels where the mean is large
    against the spread: where sum(x^2) / M2 passes RECOMPUTE_PAST (6 bits lost), this program walks its channels'
    rows once, summing d and d^2 with d = x - the sums' mean, as bn_partials_kernel does. Exact where it must be,
    free where it need not."""
    dependent_launch(PDL)
    offs_c = tl.program_id(0) * BC + tl.arange(0, BC)
    ok_c = offs_c < C
    s1 = tl.load(sums + offs_c, mask=ok_c, other=0.0)
    s2 = tl.load(sums + C + offs_c, mask=ok_c, other=0.0)
    mean = s1 / M
    m2 = s2 - s1 * mean
    m2 = tl.where(m2 < 0.0, 0.0, m2)  # not tl.maximum: a NaN must stay NaN
    lost = ok_c & (m2 * RECOMPUTE_PAST < s2)
    if sum_rows(lost.to(tl.int32)) > 0:
        cols = offs_c * s_xc
        d1 = tl.full([BP, BC], 0.0, dtype=tl.float32)
        d2 = tl.full([BP, BC], 0.0, dtype=tl.float32)
        for r0 in range(0, M, BP):
            rows = r0 + tl.arange(0, BP)
            ok = (rows < M)[:, None] & lost[None, :]
            v = tl.load(x + _row_offsets(rows, RPS, s_xs, s_xp)[:, None] + cols[None, :], mask=ok, other=0.0)
            d = tl.where(ok, v.to(tl.float32) - mean[None, :], 0.0)
            d1 += d
            d2 += d * d
        e1, e2 = sum_rows(d1), sum_rows(d2)
        m2 = tl.where(lost, tl.maximum(e2 - e1 * (e1 / M), 0.0), m2)  # (lost: finite)
        mean = tl.where(lost, mean + e1 / M, mean)
    _finish_stats(mean, m2, offs_c, ok_c, ws, save_mean, save_invstd, w, b, rm, rv, rm_out, rv_out, M, C, momentum,
                  eps, BC, HAS_W, HAS_B, HAS_RUNNING)


@triton.jit
def _finish_stats(mean, m2, offs_c, ok_c, ws, save_mean, save_invstd, w, b, rm, rv, rm_out, rv_out, M, C, momentum,
                  eps, BC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RUNNING: tl.constexpr):
    """From a channel block's mean and M2: save_mean, save_invstd, ws[0:C] = scale, ws[C:2C] = shift, and the
    new running stats."""
    invstd = tl.div_rn(1.0, tl.sqrt_rn(m2 / M + eps))
    tl.store(save_mean + offs_c, mean, mask=ok_c)
    tl.store(save_invstd + offs_c, invstd, mask=ok_c)
    scale = invstd
    if HAS_W:
        scale = scale * tl.load(w + offs_c, mask=ok_c, other=0.0).to(tl.float32)
    shift = tl.full([BC], 0.0, dtype=tl.float32)
    if HAS_B:
        shift = tl.load(b + offs_c, mask=ok_c, other=0.0).to(tl.float32)
    tl.store(ws + offs_c, scale, mask=ok_c)
    tl.store(ws + C + offs_c, shift, mask=ok_c)
    if HAS_RUNNING:
        old_mean = tl.load(rm + offs_c, mask=ok_c, other=0.0).to(tl.float32)
        old_var = tl.load(rv + offs_c, mask=ok_c, other=0.0).to(tl.float32)
        unbiased = m2 / (M - 1.0)  # M = 1: 0 / 0 = NaN, as aten
        tl.store(rm_out + offs_c, ((1.0 - momentum) * old_mean + momentum * mean).to(rm_out.dtype.element_ty),
                 mask=ok_c)
        tl.store(rv_out + offs_c, ((1.0 - momentum) * old_var + momentum * unbiased).to(rv_out.dtype.element_ty),
                 mask=ok_c)


@triton.jit
def bn_apply_mainloop(src, mean, affine, M, N, RPS, s_ss, s_sp, s_sc, s_os, s_op,
                      BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr):
    """The elementwise family's tile load, normalized: acc = (x - mean) * scale + shift (codegen's contract).
    Its strides are the tensors' own (channel vector KV = 1)."""
    acc, tile, pid_k, s_idx, p_idx, row_ok, out_rows, offs_c, row_block = ewise_mainloop(
        src, M, N, RPS, s_ss, s_sp, s_sc, s_os, s_op, BM, BN, 1, SPLIT_K)
    ok = offs_c < N
    mu = tl.load(mean + offs_c, mask=ok, other=0.0)
    scale = tl.load(affine + offs_c, mask=ok, other=0.0)
    shift = tl.load(affine + N + offs_c, mask=ok, other=0.0)
    acc = (acc - mu[None, :]) * scale[None, :] + shift[None, :]
    return acc, tile, pid_k, s_idx, p_idx, row_ok, out_rows, offs_c, row_block


FAMILY = Family(
    name="batch_norm", module=__name__, mainloop="bn_apply_mainloop",
    args=("src", "mean", "affine", "M", "N", "RPS", "s_ss", "s_sp", "s_sc", "s_os", "s_op"),
    constexprs=("BM", "BN", "SPLIT_K"),
    n_cols="N", s_out_c="s_oc",
)


# ---- configs -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BnProblem:
    rows: int  # N * H * W
    channels: int
    rows_per_sample: int  # H * W
    channels_inner: bool  # channel stride 1 (channels_last, [N, C]); else the rows are the contiguous dim
    sms: int


@dataclasses.dataclass(frozen=True)
class BnConfig:
    """One tile shape for all three passes, and how the statistics pass splits the rows."""
    block_p: int = 64  # rows per tile
    block_c: int = 64  # channels per tile
    splits: int = 1  # row splits per channel block in pass 1 (= partial statistics per channel)
    block_r: int = 1  # partials pass 2 reads per step (for TILE // block_r channels, up to block_c)
    num_warps: int = 4

    def check(self, p: BnProblem) -> bool:
        pow2 = all(v > 0 and v & (v - 1) == 0 for v in (self.block_p, self.block_c, self.block_r))
        return pow2 and 1 <= self.splits


TILE = 4096  # elements per tile: 32 fp32 registers a thread at 4 warps
MAX_SPLITS = 1024


def default_config(p: BnProblem) -> BnConfig:
    """Tiles long along the contiguous dim; about 4 programs an SM in the statistics pass. Channels-last: 64
    channels by 64 rows, the best of 72 shape-independent rules over ResNet-50's batch-norm shapes at bs256
    (`bench/bn_kernels.py --sweep`, H200: 6.18 ms a step forward, 8.06 backward; 128 channels gave 7.26 and
    9.09). The backward kernels (batch_norm_bwd.py) use the same config."""
    np2 = triton.next_power_of_2
    if p.channels_inner:
        bc = min(np2(p.channels), 64)
        bp = min(np2(p.rows), TILE // bc)
    else:
        bp = min(np2(p.rows), np2(p.rows_per_sample), 1024)
        bc = min(np2(p.channels), TILE // bp)
    want = max(1, 4 * p.sms // triton.cdiv(p.channels, bc))
    splits = min(triton.cdiv(p.rows, bp), want, MAX_SPLITS)
    return BnConfig(bp, bc, splits, min(np2(splits), 256))


# ---- launch ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _BnPlan:
    """What one call needs that depends only on shapes, strides, dtypes and the config (see plan.Plan)."""
    m: int
    c: int
    rps: int
    x_strides: tuple  # x's [S, P, C] strides (after the copy, if copy_x)
    copy_x: bool  # x's [S, P, C] form is not a view: the kernels read a contiguous copy
    y_format: torch.memory_format  # y = empty_like(x) keeps x's strides where they are an [S, P, C] view
    cfg: BnConfig
    tiles_per_split: int
    splits: int
    finalize_c: int  # channels a finalize program merges: fewer where it reads many partials a step
    has_w: bool
    has_b: bool
    has_running: bool
    apply: Plan | None  # None: the statistics alone (batch_norm_stats)
    pdl: dict  # plan.pdl_meta's options for the statistics kernels

    def run(self, x, weight, bias, running_mean, running_var, operands, signature, momentum, eps, out, sums=None):
        y = out if out is not None else torch.empty_like(x, memory_format=self.y_format)
        x, save_mean, save_invstd, ws, rm_out, rv_out = self.stats(x, weight, bias, running_mean, running_var,
                                                                   momentum, eps, sums)
        self.apply.launch((x, save_mean, ws), y, operands, signature, y.shape, 1)
        return y, save_mean, save_invstd, rm_out, rv_out

    def stats(self, x, weight, bias, running_mean, running_var, momentum, eps, sums=None):
        """Passes 1 and 2, or the second alone from the given sums: (x as the apply pass reads it, save_mean,
        save_invstd, ws (scale, shift first), new running mean, new running var)."""
        if self.copy_x:
            x = x.contiguous()
        f32 = {"dtype": torch.float32, "device": x.device}
        save_mean, save_invstd = torch.empty(self.c, **f32), torch.empty(self.c, **f32)
        # the statistics' scratch comes from the caching allocator per call (stream-ordered reuse): a buffer kept
        # across calls would be allocated inside a CUDA graph's private pool and outlive it
        ws = torch.empty(2 * self.c * (1 + (self.splits if sums is None else 0)), **f32)
        rm_out = torch.empty_like(running_mean) if self.has_running else None
        rv_out = torch.empty_like(running_var) if self.has_running else None
        cfg = self.cfg
        params = [t if t is not None else ws for t in (weight, bias, running_mean, running_var, rm_out, rv_out)]
        flags = {"HAS_W": self.has_w, "HAS_B": self.has_b, "HAS_RUNNING": self.has_running, **self.pdl}
        if sums is not None:
            launch(bn_finalize_sums_kernel, (triton.cdiv(self.c, cfg.block_c),),
                sums, x, ws, save_mean, save_invstd, *params, self.m, self.c, self.rps, *self.x_strides,
                float(momentum), float(eps), BP=cfg.block_p, BC=cfg.block_c, num_warps=cfg.num_warps, **flags)
            return x, save_mean, save_invstd, ws, rm_out, rv_out
        launch(bn_partials_kernel, (self.splits, triton.cdiv(self.c, cfg.block_c)),
            x, ws, self.m, self.c, self.rps, *self.x_strides, self.tiles_per_split, self.splits,
            BP=cfg.block_p, BC=cfg.block_c, num_warps=cfg.num_warps, **self.pdl)
        launch(bn_finalize_kernel, (triton.cdiv(self.c, self.finalize_c),),
            ws, save_mean, save_invstd, *params, self.m, self.c, self.splits, self.tiles_per_split * cfg.block_p,
            float(momentum), float(eps), BC=self.finalize_c, BR=cfg.block_r, **flags)
        return x, save_mean, save_invstd, ws, rm_out, rv_out


_PLANS: dict = {}


def batch_norm_train(x: torch.Tensor, weight, bias, running_mean, running_var, operands, signature: str,
                     momentum: float, eps: float, out: torch.Tensor | None = None, config: BnConfig | None = None,
                     sums: torch.Tensor | None = None):
    """Training batch norm + epilogue; see the module docstring for the return conventions and `sums`."""
    key = plan_key("batch_norm", signature, config, x, weight, bias, running_mean, running_var, out, *operands)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(x, weight, bias, running_mean, running_var, operands, signature, out, config)
    _check_sums(sums, x)
    return plan.run(x, weight, bias, running_mean, running_var, operands, signature, momentum, eps, out, sums)


def _check_sums(sums: torch.Tensor | None, x: torch.Tensor) -> None:
    if sums is not None and (sums.shape != (2, x.shape[1]) or sums.dtype != torch.float32
                             or sums.device != x.device or not sums.is_contiguous()):
        raise ValueError(f"sums must be a contiguous fp32 [2, {x.shape[1]}] tensor on {x.device}, got "
                         f"{sums.dtype} {tuple(sums.shape)} on {sums.device}")


def batch_norm_stats(x: torch.Tensor, weight, bias, running_mean, running_var, momentum: float, eps: float,
                     config: BnConfig | None = None, sums: torch.Tensor | None = None):
    """Training batch norm's statistics alone -> (save_mean, save_invstd, new_running_mean, new_running_var,
    scale_shift): what aten._native_batch_norm_legit_functional returns but y, and fp32 [2, C], the per-channel
    scale (invstd * weight) and shift (bias) that y = (x - save_mean) * scale + shift would take. For a batch
    norm whose output another batch norm's epilogue reads (epilogue.py's normalize op). One tensor, not two
    views of one workspace: an op's outputs may not alias each other."""
    key = plan_key("batch_norm_stats", config, x, weight, bias, running_mean, running_var)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(x, weight, bias, running_mean, running_var, [], None, None, config)
    _check_sums(sums, x)
    _, save_mean, save_invstd, ws, rm_out, rv_out = plan.stats(x, weight, bias, running_mean, running_var, momentum,
                                                               eps, sums)
    return save_mean, save_invstd, rm_out, rv_out, ws[:2 * plan.c].view(2, plan.c)


def _plan(x, weight, bias, running_mean, running_var, operands, signature, out, config) -> _BnPlan:
    if x.dtype not in _DTYPES or x.dim() < 2:
        raise TypeError(f"batch norm kernel takes an fp16/bf16/fp32 [N, C, *] input, got {x.dtype} "
                        f"{tuple(x.shape)}")
    if x.numel() == 0:
        raise RuntimeError(f"batch norm input must have at least one element, got {tuple(x.shape)}")
    c = x.shape[1]
    for name, t in (("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var)):
        if t is not None and (t.shape != (c,) or t.device != x.device):
            raise ValueError(f"{name} must be a [{c}] tensor on {x.device}, got {tuple(t.shape)} on {t.device}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must be given together")
    copy_x = not _is_view3(x)
    x3 = epi.rows3(x.contiguous() if copy_x else x, x.shape, 1)
    rps = x3.shape[1]
    cfg, m, tiles_per_split, splits = row_splits(x3, x.device, config)
    y_format, apply = torch.preserve_format, None
    if signature is not None:  # else the statistics alone (batch_norm_stats): no y, no apply pass
        y_format, apply = _apply_plan(x, x3, c, m, rps, cfg, operands, signature, out)
    finalize_c = min(cfg.block_c, max(1, TILE // cfg.block_r))
    return _BnPlan(m, c, rps, x3.stride(), copy_x, y_format, cfg, tiles_per_split, splits, finalize_c,
                   weight is not None, bias is not None, running_mean is not None, apply, pdl_meta(x.device))


def _apply_plan(x, x3, c, m, rps, cfg, operands, signature, out) -> tuple[torch.memory_format, Plan]:
    """y's memory format and the generated apply kernel's plan (pass 3)."""
    y_format = torch.preserve_format
    if out is None and not _is_view3(torch.empty_like(x)):
        y_format = torch.contiguous_format  # x's strides are no [S, P, C] view (say H and W swapped)
    y = out if out is not None else torch.empty_like(x, memory_format=y_format)
    if y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        raise ValueError(f"out must match x: {tuple(y.shape)} {y.dtype} on {y.device}, x {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}")
    if not _is_view3(y):
        raise NotImplementedError(f"output strides {y.stride()} are not an [S, P, C] view")
    y3 = epi.rows3(y, y.shape, 1)
    tiles = triton.cdiv(m, cfg.block_p) * triton.cdiv(c, cfg.block_c)
    head = [m, c, rps, *x3.stride(), y3.stride(0), y3.stride(1), y3.stride(2)]
    meta = {"BM": cfg.block_p, "BN": cfg.block_c, "SPLIT_K": 1, "num_warps": cfg.num_warps}
    return y_format, Plan(codegen.load(FAMILY, signature), (tiles, 1, 1), head,
                          operand_strides(signature, operands, y.shape, 1), meta,
                          (tiles, 1, cfg.block_p, cfg.block_c), y.device)


def row_splits(x3: torch.Tensor, device: torch.device, config: BnConfig | None) -> tuple:
    """(config, rows, tiles per split, splits) for the [S, P, C] view x3: the statistics passes' row split, shared
    with the backward kernels."""
    s, rps, c = x3.shape
    m = s * rps
    problem = BnProblem(m, c, rps, x3.stride(2) == 1, sm_count(device))
    cfg = config or default_config(problem)
    if not cfg.check(problem):
        raise ValueError(f"illegal batch norm config {cfg}")
    tiles_per_split = triton.cdiv(triton.cdiv(m, cfg.block_p), cfg.splits)
    splits = triton.cdiv(triton.cdiv(m, cfg.block_p), tiles_per_split)  # no split left empty
    return cfg, m, tiles_per_split, splits


def _is_view3(t: torch.Tensor) -> bool:
    """Is t's [S, P, C] form (channel dim 1) a view of it, with no broadcast rows or channels?"""
    t3 = epi.rows3(t, t.shape, 1)
    return t3.data_ptr() == t.data_ptr() and all(st != 0 or n == 1 for n, st in zip(t3.shape[1:], t3.stride()[1:]))
