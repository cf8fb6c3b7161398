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
mean are forward values, alive since the forward, so no lifetime grows.

Then (switch `bn_backward_dual`): two such batch-norm backwards with the same grad_out, as a downsampling block's
main and shortcut batch norms have, become one resfuse::batch_norm_backward_dual at the first one's place, whose
passes read grad_out once for both. The second one's gradient is then made earlier, but its x, which it replaces
in memory byte for byte, dies there too (the rewrite asks that x be read by nothing later), so the peak does not
grow. The report lists the rewrites; refusals say why.
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
BN_BWD = torch.ops.resfuse.batch_norm_backward.default
DUAL = torch.ops.resfuse.batch_norm_backward_dual.default


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
    paired = _pair_by_grad_out(gm.graph, ctx) if ctx.config.bn_backward_dual else 0
    if summed or paired:
        gm.graph.lint()  # the sums and pairing rewrites moved nodes: check the graph's order before it runs
    if done:
        gm.recompile()
        ctx.report.rewrites.append(f"{ctx.graph} graph: {done} batch-norm backward(s) on resfuse's kernel")
    if summed:
        ctx.report.rewrites.append(f"{ctx.graph} graph: {summed} batch-norm backward(s) take sum(g) and "
                                   "sum(g * (x - mean)) from the epilogue of the conv data gradient that computes g")
    if paired:
        ctx.report.rewrites.append(f"{ctx.graph} graph: {paired} pair(s) of batch-norm backwards with one grad_out "
                                   "run as one, reading it once")
    return gm


def _pair_by_grad_out(graph: fx.Graph, ctx) -> int:
    """Merge pairs of resfuse::batch_norm_backward (no sums) that read the same grad_out; returns how many."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_grad: dict[fx.Node, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target == BN_BWD and len(n.args) == 7 and n.args[-1] == "triton":
            by_grad.setdefault(n.args[0], []).append(n)
    paired = 0
    for first, second, *_ in (bns for bns in by_grad.values() if len(bns) >= 2):
        why = _pair_refusal(first, second, order)
        if why:
            ctx.reject(second, f"batch-norm backward not paired with {first.name}, which shares its grad_out: {why}")
            continue
        g, x, w, mean, invstd, eps, provider = first.args
        args = (g, x, w, mean, invstd, second.args[1], second.args[2], second.args[3], second.args[4], eps,
                second.args[5], provider)
        with graph.inserting_before(first):
            dual = graph.call_function(DUAL, args)
        dual.meta["val"] = fake_call(DUAL, args)
        for offset, old in ((0, first), (3, second)):
            for item in list(old.users):  # getitems: the op's outputs are only ever read through them
                item.update_arg(0, dual)
                item.update_arg(1, item.args[1] + offset)
            graph.erase_node(old)
        paired += 1
    return paired


def _pair_refusal(first: fx.Node, second: fx.Node, order: dict) -> str | None:
    if any(u.op != "call_function" or u.target != operator.getitem for n in (first, second) for u in n.users):
        return "an output is read other than through getitem"
    x, x2 = legality.val(first.args[1]), legality.val(second.args[1])
    if x is None or x2 is None or (x.shape, x.stride(), x.dtype) != (x2.shape, x2.stride(), x2.dtype):
        return "the two inputs differ in shape, strides or dtype"
    if any(isinstance(a, fx.Node) and order[a] > order[first] for a in second.args[1:5]):
        return "its inputs are computed after the first one runs"
    if any(order[u] > order[second] for u in second.args[1].users):
        return f"its input {second.args[1].name} is read later, so its gradient made earlier would add to the peak"
    return None


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
