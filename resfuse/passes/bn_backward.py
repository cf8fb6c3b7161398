"""Training batch-norm backward onto resfuse's kernel: each aten.native_batch_norm_backward in training mode
becomes resfuse::batch_norm_backward (ops/training.py) where the fused ops run on Triton.

Entry point: `batch_norm_backward(gm, ctx)`, a pass after the fusion passes. Its input is the conv
data-gradient the fusion passes already gave relu's gradient and the skip-gradient add. It replaces ATen's two
kernels (a reduction, then the elementwise pass) by our three, which read grad_out and x in one layout-aware
pass each.

Then a fusion (switch `bn_backward_sums`): where grad_out comes from a resfuse::conv2d_dgrad, that op computes
the two per-channel sums the first pass would (sum(g), sum(g * (x - mean))) in its epilogue, over the g it has
just computed: its epilogue gains a bn_stats root with x and mean as operands, it becomes
resfuse::conv2d_dgrad_stats, and the batch norm's backward takes the sums (`sums`) and skips that pass. The pass
read g and x; the epilogue reads x only. g's other readers (a skip connection's gradient) are unchanged; x and
mean are forward values, alive since the forward, so no lifetime grows. The report lists both rewrites;
refusals say why.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import epilogue as epi
from . import legality
from .group import fake_call

aten = torch.ops.aten
NATIVE = aten.native_batch_norm_backward.default
DGRAD = torch.ops.resfuse.conv2d_dgrad.default
DGRAD_STATS = torch.ops.resfuse.conv2d_dgrad_stats.default


def batch_norm_backward(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if not ctx.config.batch_norm_backward:
        return gm
    done, summed = 0, 0
    for node in list(gm.graph.nodes):
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
        if ctx.config.bn_backward_sums:
            why = _sums_in_producer(node)
            if why:
                ctx.reject(node, f"batch-norm backward's sums stay a pass of their own: {why}")
            summed += why is None
    if summed:
        gm.graph.lint()  # the sums rewrite moved nodes: check the graph's order before it runs
    if done:
        gm.recompile()
        ctx.report.rewrites.append(f"{ctx.graph} graph: {done} batch-norm backward(s) on resfuse's kernel")
    if summed:
        ctx.report.rewrites.append(f"{ctx.graph} graph: {summed} batch-norm backward(s) take sum(g) and "
                                   "sum(g * (x - mean)) from the epilogue of the conv data gradient that computes g")
    return gm


def _sums_in_producer(bn: fx.Node) -> str | None:
    """Move the sums of `bn` (a resfuse::batch_norm_backward) into its grad_out's producer, or say why not."""
    grad_out, x, _weight, save_mean = bn.args[:4]
    producer = grad_out
    if not (isinstance(producer, fx.Node) and producer.op == "call_function" and producer.target == DGRAD):
        what = producer.target if isinstance(producer, fx.Node) and producer.op == "call_function" else producer
        return f"grad_out comes from {what}, not a fused conv data gradient"
    go, w, operands, signature, input_shape, stride, padding, dilation, provider = producer.args
    tree = epi.parse(signature)
    if epi.out_dtype(tree, None) is not None:
        return "the data gradient is stored in fp32 (a float32 marker)"
    if any(o.slot >= len(operands) for o in epi.operands(tree)):
        return f"epilogue {signature} has operand slots past its {len(operands)} operands"
    order = {n: i for i, n in enumerate(bn.graph.nodes)}
    for t in (x, save_mean):
        if not isinstance(t, fx.Node) or order[t] > order[producer]:
            return f"{getattr(t, 'name', t)} is computed after the data gradient"
    if legality.val(x) is None or legality.val(x).shape != legality.val(producer).shape:
        return "x's shape differs from the data gradient's"
    n = len(operands)
    stats_sig = str(epi.Op("bn_stats", (tree, epi.Operand(n, "full"), epi.Operand(n + 1, "c"))))
    args = (go, w, [*operands, x, save_mean], stats_sig, input_shape, stride, padding, dilation, provider)
    graph = bn.graph
    with graph.inserting_before(producer):
        new = graph.call_function(DGRAD_STATS, args)
        g_item = graph.call_function(operator.getitem, (new, 0))
        sums = graph.call_function(operator.getitem, (new, 1))
    new.meta["val"] = fake_call(DGRAD_STATS, args)
    g_item.meta["val"], sums.meta["val"] = new.meta["val"]
    new.meta["resfuse"] = {**producer.meta.get("resfuse", {"anchor": "conv2d_dgrad", "sources": [producer.name]}),
                           "signature": stats_sig}
    producer.replace_all_uses_with(g_item)
    graph.erase_node(producer)
    bn.args = (*bn.args[:7], sums)
    return None


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
