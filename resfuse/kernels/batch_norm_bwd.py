"""Training batch-norm backward: what aten.native_batch_norm_backward(grad_out, x, weight, ..., save_mean,
save_invstd, True, eps, output_mask) computes, in three deterministic passes over memory.

Entry point: `batch_norm_backward(grad_out, x, weight, save_mean, save_invstd, output_mask, grad_input=None,
config=None, sums=None, second=None) -> (grad_input, grad_weight, grad_bias)`, reached through resfuse.kernels
(ops/training.py calls it for the resfuse::batch_norm_backward op that passes/bn_backward.py puts in backward
graphs). With `second`, a `Norm` (x, weight, save_mean, save_invstd, grad_input) of another batch norm whose
grad_out is the same tensor (a downsampling block's main and shortcut batch norms), it returns both batch norms'
three gradients, and passes 1 and 3 read grad_out once for the two.

With g = grad_out, xmu = x - save_mean and M = N * H * W rows per channel:
  1. `bnb_partials_kernel`, grid (row splits, channel blocks): per split, sum(g) and sum(g * xmu), added up in
     per-lane fp32 registers and summed over the lanes once at the end (the statistics pass's shape, batch_norm.py).
  2. `bnb_finalize_kernel`, grid (channel blocks): adds the splits up in a fixed order (no atomics, so the result
     is bit-identical run to run); grad_bias = sum(g), grad_weight = sum(g * xmu) * invstd; and the per-channel
     coefficients of grad_input = a * g + b * xmu + c, with a = weight * invstd, b = -a * invstd^2 * sum(g * xmu)
     / M and c = -a * sum(g) / M (ATen's batch_norm_backward_elemt, rearranged).
     With `sums` (fp32 [2, C]: sum(g), sum(g * xmu)), which grad_out's producer computed in its epilogue
     (a bn_stats root, passes/bn_backward.py), pass 1 is skipped and finalize reads those as a single split.
  3. `bnb_apply_kernel`, one program per tile of rows and channels, the channel blocks of a row tile one after
     another (so together they read whole rows of a channels_last tensor), from the last rows to the first
     (elementwise.py says why): reads g and x once more and writes grad_input.

x and grad_out are [N, C, *] at any strides whose [S, P, C] form is a view (contiguous, channels_last, [N, C]);
others are read through a contiguous copy. grad_input is written at `grad_input`'s strides (ops/training.py
allocates it as ATen would); the two parameter gradients in the weight's dtype (x's without a weight), None where
output_mask says so. A NaN or Inf in a channel of g or x makes that channel's gradients NaN, as in eager.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import epilogue as epi
from .activations import sum_rows
from .batch_norm import _DTYPES, TILE, BnConfig, _is_view3, _row_offsets, row_splits
from .plan import launch, pdl_meta, plan_key
from .tiles import cdiv, dependent_launch



@triton.jit
def bnb_partials_kernel(g, x, mean, x2, mean2, part, M, C, RPS, s_gs, s_gp, s_gc, s_xs, s_xp, s_xc, TILES_PER_SPLIT,
                        SPLITS, BP: tl.constexpr, BC: tl.constexpr, DUAL: tl.constexpr, PDL: tl.constexpr):
    """sum(g), sum(g * (x - mean)) and, where DUAL, sum(g * (x2 - mean2)) of one split of rows for BC channels,
    into part[k * SPLITS * C + split * C + c] for k = 0, 1, 2."""
    dependent_launch(PDL)
    pid_r = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    ok_c = offs_c < C
    mu = tl.load(mean + offs_c, mask=ok_c, other=0.0)
    mu2 = tl.load(mean2 + offs_c, mask=ok_c, other=0.0)
    t_lo = pid_r * TILES_PER_SPLIT
    t_hi = tl.minimum(t_lo + TILES_PER_SPLIT, cdiv(M, BP))
    s_g = tl.full([BP, BC], 0.0, dtype=tl.float32)
    s_gx = tl.full([BP, BC], 0.0, dtype=tl.float32)
    s_gx2 = tl.full([BP, BC], 0.0, dtype=tl.float32)
    for t in range(t_lo, t_hi):  # one tile a step: two a step (as the statistics pass) measured 9% slower here
        rows = t * BP + tl.arange(0, BP)
        ok = (rows < M)[:, None] & ok_c[None, :]
        gv = tl.load(g + _row_offsets(rows, RPS, s_gs, s_gp)[:, None] + (offs_c * s_gc)[None, :], mask=ok,
                     other=0.0).to(tl.float32)
        at_x = _row_offsets(rows, RPS, s_xs, s_xp)[:, None] + (offs_c * s_xc)[None, :]
        xv = tl.load(x + at_x, mask=ok, other=0.0).to(tl.float32)
        s_g += gv
        s_gx += tl.where(ok, gv * (xv - mu[None, :]), 0.0)
        if DUAL:  # a second batch norm of the same grad_out (x2 at x's strides): g is read once for both
            x2v = tl.load(x2 + at_x, mask=ok, other=0.0).to(tl.float32)
            s_gx2 += tl.where(ok, gv * (x2v - mu2[None, :]), 0.0)
    out = part + pid_r * C + offs_c
    tl.store(out, sum_rows(s_g), mask=ok_c)
    tl.store(out + SPLITS * C, sum_rows(s_gx), mask=ok_c)
    if DUAL:
        tl.store(out + 2 * SPLITS * C, sum_rows(s_gx2), mask=ok_c)


@triton.jit
def bnb_finalize_kernel(ws, part_g, part_gx, invstd, w, grad_w, grad_b, M, C, SPLITS,
                        BC: tl.constexpr, BR: tl.constexpr, HAS_W: tl.constexpr, WANT_W: tl.constexpr,
                        WANT_B: tl.constexpr, PDL: tl.constexpr):
    """Add the splits up for BC channels (part_g[r*C + c] and part_gx[r*C + c], r < SPLITS); write the
    parameter gradients and ws[0:3C] = (a, b, c)."""
    dependent_launch(PDL)
    offs_c = tl.program_id(0) * BC + tl.arange(0, BC)
    ok_c = offs_c < C
    acc_g = tl.full([BR, BC], 0.0, dtype=tl.float32)
    acc_gx = tl.full([BR, BC], 0.0, dtype=tl.float32)
    for r0 in range(0, SPLITS, BR):
        r = r0 + tl.arange(0, BR)
        ok = (r < SPLITS)[:, None] & ok_c[None, :]
        at = r[:, None] * C + offs_c[None, :]
        acc_g += tl.load(part_g + at, mask=ok, other=0.0)
        acc_gx += tl.load(part_gx + at, mask=ok, other=0.0)
    sum_g = sum_rows(acc_g)
    sum_gx = sum_rows(acc_gx)
    istd = tl.load(invstd + offs_c, mask=ok_c, other=0.0).to(tl.float32)
    if WANT_W:
        tl.store(grad_w + offs_c, (sum_gx * istd).to(grad_w.dtype.element_ty), mask=ok_c)
    if WANT_B:
        tl.store(grad_b + offs_c, sum_g.to(grad_b.dtype.element_ty), mask=ok_c)
    a = istd
    if HAS_W:
        a = a * tl.load(w + offs_c, mask=ok_c, other=0.0).to(tl.float32)
    tl.store(ws + offs_c, a, mask=ok_c)
    tl.store(ws + C + offs_c, -a * istd * istd * sum_gx / M, mask=ok_c)
    tl.store(ws + 2 * C + offs_c, -a * sum_g / M, mask=ok_c)


@triton.jit
def bnb_apply_kernel(g, x, mean, ws, dx, x2, mean2, ws2, dx2, M, C, RPS, s_gs, s_gp, s_gc, s_xs, s_xp, s_xc,
                     s_os, s_op, s_oc, BP: tl.constexpr, BC: tl.constexpr, DUAL: tl.constexpr, PDL: tl.constexpr):
    """grad_input = a * g + b * (x - mean) + c for a BP x BC tile; where DUAL, also dx2 from x2, mean2 and ws2's
    coefficients (x2 and dx2 at x's and dx's strides)."""
    dependent_launch(PDL)
    blocks_c = cdiv(C, BC)
    rows = (cdiv(M, BP) - 1 - tl.program_id(0) // blocks_c) * BP + tl.arange(0, BP)
    offs_c = (tl.program_id(0) % blocks_c) * BC + tl.arange(0, BC)
    ok_c = offs_c < C
    ok = (rows < M)[:, None] & ok_c[None, :]
    gv = tl.load(g + _row_offsets(rows, RPS, s_gs, s_gp)[:, None] + (offs_c * s_gc)[None, :], mask=ok,
                 other=0.0).to(tl.float32)
    at_x = _row_offsets(rows, RPS, s_xs, s_xp)[:, None] + (offs_c * s_xc)[None, :]
    at_o = _row_offsets(rows, RPS, s_os, s_op)[:, None] + (offs_c * s_oc)[None, :]
    _bnb_apply_one(gv, x, mean, ws, dx, at_x, at_o, offs_c, ok_c, ok, C)
    if DUAL:
        _bnb_apply_one(gv, x2, mean2, ws2, dx2, at_x, at_o, offs_c, ok_c, ok, C)


@triton.jit
def _bnb_apply_one(gv, x, mean, ws, dx, at_x, at_o, offs_c, ok_c, ok, C):
    xv = tl.load(x + at_x, mask=ok, other=0.0).to(tl.float32)
    mu = tl.load(mean + offs_c, mask=ok_c, other=0.0)
    a = tl.load(ws + offs_c, mask=ok_c, other=0.0)
    b = tl.load(ws + C + offs_c, mask=ok_c, other=0.0)
    c = tl.load(ws + 2 * C + offs_c, mask=ok_c, other=0.0)
    res = a[None, :] * gv + b[None, :] * (xv - mu[None, :]) + c[None, :]
    tl.store(dx + at_o, res.to(dx.dtype.element_ty), mask=ok)


@dataclasses.dataclass
class _BnbPlan:
    """What one call needs that depends only on shapes, strides, dtypes and the config (see plan.Plan)."""
    m: int
    c: int
    rps: int
    copy: tuple  # (grad_out, x): read through a contiguous copy (no [S, P, C] view)
    strides: tuple  # grad_out's, x's and grad_input's [S, P, C] strides, 9 ints
    cfg: BnConfig
    tiles_per_split: int
    splits: int
    finalize_c: int
    pdl: dict  # plan.pdl_meta's options for the three kernels

    def run(self, g, norms, mask, sums=None):
        """norms: one or two Norm (x, weight, save_mean, save_invstd, grad_input) of batch norms whose grad_out is g,
        the second's x and grad_input at the first's strides -> each one's (grad_input, grad_weight, grad_bias)."""
        g = g.contiguous() if self.copy[0] else g
        norms = [n._replace(x=n.x.contiguous()) if self.copy[1] else n for n in norms]
        x, dual = norms[0].x, len(norms) == 2
        f32 = {"dtype": torch.float32, "device": x.device}
        splits = 1 if sums is not None else self.splits
        # per call: see batch_norm._BnPlan.run. Each batch norm's (a, b, c), then the splits' partial sums: sum(g),
        # then sum(g * (x - mean)) for each batch norm (unless given)
        n_coef = 3 * self.c * len(norms)
        ws = torch.empty(n_coef + (0 if sums is not None else (1 + len(norms)) * splits * self.c), **f32)
        cfg, blocks_c = self.cfg, triton.cdiv(self.c, self.cfg.block_c)
        second = norms[-1]
        if sums is None:
            launch(bnb_partials_kernel, (splits, blocks_c),
                g, x, norms[0].save_mean, second.x, second.save_mean, ws[n_coef:], self.m, self.c, self.rps,
                *self.strides[:6], self.tiles_per_split, splits, BP=cfg.block_p, BC=cfg.block_c, DUAL=dual,
                num_warps=cfg.num_warps, **self.pdl)
        part = sums.view(-1) if sums is not None else ws[n_coef:]
        results, coefs = [], []
        for k, n in enumerate(norms):
            grad_dtype = n.weight.dtype if n.weight is not None else n.x.dtype  # what aten returns
            grad_w = torch.empty(self.c, dtype=grad_dtype, device=x.device) if mask[1] else None
            grad_b = torch.empty(self.c, dtype=grad_dtype, device=x.device) if mask[2] else None
            coefs.append(ws[3 * self.c * k:])
            launch(bnb_finalize_kernel, (triton.cdiv(self.c, self.finalize_c),),
                coefs[k], part, part[(1 + k) * splits * self.c:], n.save_invstd,
                *(t if t is not None else ws for t in (n.weight, grad_w, grad_b)), self.m, self.c, splits,
                BC=self.finalize_c, BR=cfg.block_r, HAS_W=n.weight is not None, WANT_W=bool(mask[1]),
                WANT_B=bool(mask[2]), **self.pdl)
            results += [n.grad_input if mask[0] else None, grad_w, grad_b]
        if mask[0]:
            launch(bnb_apply_kernel, (triton.cdiv(self.m, cfg.block_p) * blocks_c,),
                g, x, norms[0].save_mean, coefs[0], norms[0].grad_input, second.x, second.save_mean, coefs[-1],
                second.grad_input, self.m, self.c, self.rps, *self.strides, BP=cfg.block_p, BC=cfg.block_c,
                DUAL=dual, num_warps=cfg.num_warps, **self.pdl)
        return tuple(results)


class Norm(NamedTuple):
    """One batch norm's side of a backward: its input, parameters' weight, saved statistics and grad_input."""
    x: torch.Tensor
    weight: torch.Tensor | None
    save_mean: torch.Tensor
    save_invstd: torch.Tensor
    grad_input: torch.Tensor | None = None


_PLANS: dict = {}


def batch_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight, save_mean: torch.Tensor,
                        save_invstd: torch.Tensor, output_mask, grad_input: torch.Tensor | None = None,
                        config: BnConfig | None = None, sums: torch.Tensor | None = None,
                        second: Norm | None = None):
    """Training batch-norm backward; see the module docstring. grad_input defaults to torch.empty_like(x).
    `second`: another batch norm whose grad_out is also grad_out (a downsampling block's main and shortcut batch
    norms): both backwards in one set of passes that read grad_out once, returning six gradients, the second's
    last. Where its x or grad_input is not at the first's strides, the two run one after the other."""
    mask = tuple(bool(m) for m in output_mask)
    norms = [Norm(x, weight, save_mean, save_invstd, grad_input), *([second] if second is not None else [])]
    if mask[0]:
        norms = [n if n.grad_input is not None else n._replace(grad_input=torch.empty_like(n.x)) for n in norms]
    if sums is not None and (sums.shape != (2, x.shape[1]) or sums.dtype != torch.float32
                             or not sums.is_contiguous() or sums.device != x.device or second is not None):
        raise ValueError(f"sums must be a contiguous fp32 [2, {x.shape[1]}] tensor on {x.device} (and no second "
                         f"batch norm), got {tuple(sums.shape)} {sums.dtype}")
    if second is not None and not _same_strides(norms, mask):
        return tuple(r for n in norms for r in batch_norm_backward(grad_out, *n[:4], mask, n.grad_input, config))
    key = plan_key("batch_norm_backward", mask, config, grad_out,
                   *(t for n in norms for t in (n.x, n.weight, n.save_mean, n.save_invstd,
                                                n.grad_input if mask[0] else None)))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(grad_out, norms, mask, config)
    return plan.run(grad_out, norms, mask, sums)


def _same_strides(norms, mask) -> bool:
    """Can the second batch norm's tensors be read and written at the first's strides?"""
    (x, *_, dx), (x2, *_, dx2) = norms
    pairs = [(x, x2), (dx, dx2)] if mask[0] else [(x, x2)]
    return all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()
               for a, b in pairs)


def _plan(g, norms, mask, config) -> _BnbPlan:
    x, dx = norms[0].x, norms[0].grad_input
    if x.dtype not in _DTYPES or g.dtype not in _DTYPES or x.dim() < 2:
        raise TypeError(f"batch norm backward takes fp16/bf16/fp32 [N, C, *] tensors, got {g.dtype} and {x.dtype} "
                        f"{tuple(x.shape)}")
    if g.shape != x.shape or g.device != x.device:
        raise ValueError(f"grad_out {tuple(g.shape)} on {g.device} must match x {tuple(x.shape)} on {x.device}")
    if x.numel() == 0:
        raise RuntimeError(f"batch norm backward input must have at least one element, got {tuple(x.shape)}")
    c = x.shape[1]
    for n in norms:
        for name, t in (("weight", n.weight), ("save_mean", n.save_mean), ("save_invstd", n.save_invstd)):
            if t is not None and (t.shape != (c,) or t.device != x.device):
                raise ValueError(f"{name} must be a [{c}] tensor on {x.device}, got {tuple(t.shape)} on {t.device}")
        if n.save_mean.dtype != torch.float32 or n.save_invstd.dtype != torch.float32:
            raise TypeError(f"save_mean and save_invstd must be fp32, got {n.save_mean.dtype}, {n.save_invstd.dtype}")
    if mask[0]:
        if dx.shape != x.shape or dx.device != x.device or dx.dtype not in _DTYPES:
            raise ValueError(f"grad_input {tuple(dx.shape)} {dx.dtype} must match x {tuple(x.shape)}")
        if not _is_view3(dx):
            raise NotImplementedError(f"grad_input strides {dx.stride()} are not an [S, P, C] view")
    copy = (not _is_view3(g), not _is_view3(x))
    g3 = epi.rows3(g.contiguous() if copy[0] else g, g.shape, 1)
    x3 = epi.rows3(x.contiguous() if copy[1] else x, x.shape, 1)
    o3 = epi.rows3(dx, dx.shape, 1) if mask[0] else x3
    rps = x3.shape[1]
    cfg, m, tiles_per_split, splits = row_splits(x3, x.device, config)
    finalize_c = min(cfg.block_c, max(1, TILE // cfg.block_r))
    return _BnbPlan(m, c, rps, copy, (*g3.stride(), *x3.stride(), *o3.stride()), cfg, tiles_per_split, splits,
                    finalize_c, pdl_meta(x.device))
