"""Training batch-norm backward onto resfuse's kernel: each aten.native_batch_norm_backward in training mode
becomes resfuse::batch_norm_backward (ops/training.py) where the fused ops run on Triton.

Entry point: `batch_norm_backward(gm, ctx)`, a pass after the fusion passes. Not a fusion: the op's input is
the conv data-gradient the fusion passes already gave relu's gradient and the skip-gradient add. It replaces
ATen's two kernels (a reduction, then the elementwise pass) by our three, which read grad_out and x in one
layout-aware pass each. The report lists the rewrite; refusals say why.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import legality
from .group import fake_call

aten = torch.ops.aten
NATIVE = aten.native_batch_norm_backward.default


def batch_norm_backward(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if not ctx.config.batch_norm_backward:
        return gm
    done = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != NATIVE:
            continue
        grad_out, x, weight, _rm, _rv, save_mean, save_invstd, train, eps, mask = node.args
        if ctx.provider_for(x) != "triton":
            continue  # ATen's path anyway (CPU without the interpreter, or providers=("aten",))
        why = _refusal(grad_out, x, save_mean, save_invstd, train, mask)
        if why:
            ctx.reject(node, why)
            continue
        node.target = torch.ops.resfuse.batch_norm_backward.default
        node.args = (grad_out, x, weight, save_mean, save_invstd, float(eps), "triton")
        node.meta["val"] = fake_call(node.target, node.args)  # all three gradients, the masked-off ones too
        done += 1
    if done:
        gm.recompile()
        ctx.report.rewrites.append(f"{ctx.graph} graph: {done} batch-norm backward(s) on resfuse's kernel")
    return gm


def _refusal(grad_out, x, save_mean, save_invstd, train, mask) -> str | None:
    if not train:
        return "batch-norm backward in eval mode (running statistics)"
    if not mask[0]:
        return "batch-norm backward without grad_input"
    if save_mean is None or save_invstd is None:
        return "batch-norm backward without saved statistics"
    why = legality.first(legality.supported_dtype(grad_out), legality.supported_dtype(x))
    if why:
        return f"batch-norm backward: {why}"
    if legality.val(x) is None or legality.val(x).dim() < 2:
        return "batch-norm backward of a tensor below 2-D (or without metadata)"
    if legality.val(save_mean).dtype != torch.float32:
        return f"batch-norm backward with {legality.val(save_mean).dtype} statistics"
    return None
