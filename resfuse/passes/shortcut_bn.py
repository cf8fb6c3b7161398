"""A residual block's shortcut batch norm, folded into the batch norm of its main path.

Entry point: `shortcut_bn(gm, ctx)`, a pass after FuseAddToOutput. In a downsampling bottleneck the shortcut is
conv -> batch norm, and FuseAddToOutput made its output a full operand of the main path's fused batch norm:
relu(add(acc, full0)). That shortcut batch norm still ran as two passes of its own (statistics, then y =
(x - mean) * scale + shift, written out) and the fused op read y back. Here it becomes resfuse::batch_norm_stats
(ops/training.py: the statistics pass alone) and the fused op reads its input x instead, normalizing it in the
epilogue: relu(add(acc, normalize(full0, c1, c2, c3))) over x, save_mean, scale and shift. That saves writing y
and reading it back, a pass over the tensor each.

At 1x1 spatial the shortcut's output is an "nc" operand ([N, C, 1, 1]) rather than a full one, and folds the same.
Only where the fused op runs our kernels: on ATen's path it would gain nothing and only change eager's rounding.
Legal when y is read by the fused op alone and the batch norm is in training mode; x is the conv output that the
batch norm's backward keeps anyway, so no tensor lives longer. The saved statistics and the new running stats
come from the stats op, as before from the batch norm. The report lists each fold as a rewrite, and the folded
batch norm among the fused op's sources.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import epilogue as epi
from . import legality
from .group import BN_TRAIN, fake_call, first_output_of, signature

FUSED_BN = torch.ops.resfuse.batch_norm.default
aten = torch.ops.aten
STATS = torch.ops.resfuse.batch_norm_stats.default


def shortcut_bn(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if not ctx.config.fuse_epilogue or ctx.graph == "backward":
        return gm
    folded = []
    for main in list(gm.graph.nodes):
        if main.op != "call_function" or main.target != FUSED_BN or main.args[-1] != "triton":
            continue  # on ATen's path (CPU without the interpreter) both batch norms are ATen's anyway
        tree = epi.parse(signature(main))
        for o in epi.operands(tree):
            y = main.args[5][o.slot]
            origin = first_output_of(y)
            # "nc": a [N, C, 1, 1] operand (a block at 1x1 spatial), normalized elementwise just the same
            if o.kind not in ("full", "nc") or origin is None or origin.target != BN_TRAIN:
                continue
            why = _refusal(y, origin)
            if why:
                ctx.reject(origin, f"shortcut batch norm not folded into {main.name}: {why}")
                continue
            tree = _fold(main, tree, o, origin)
            folded.append(origin.name)
    if folded:
        gm.graph.lint()
        gm.recompile()
        ctx.report.rewrites.append(f"{ctx.graph} graph: {len(folded)} shortcut batch norm(s) folded into the main "
                                   f"path's fused batch norm ({', '.join(folded)}): their statistics alone run")
    return gm


def _refusal(y: fx.Node, origin: fx.Node) -> str | None:
    x, training = origin.args[0], origin.args[5]
    if not training:
        return "not in training mode"
    why = legality.first(legality.sole_consumer(y), legality.no_mutation(origin, x))
    if why:
        return why
    xv, yv = legality.val(x), legality.val(y)
    if xv is None or yv is None or xv.shape != yv.shape or xv.dtype != yv.dtype:
        return "its input's shape or dtype differs from its output's"
    return None


def _fold(main: fx.Node, tree: epi.Node, leaf: epi.Operand, origin: fx.Node) -> epi.Node:
    """Replace `leaf` (origin's output) in main's epilogue by normalize(origin's input, ...); returns the tree."""
    graph = main.graph
    x, w, b, rm, rv, _training, momentum, eps = origin.args[:8]
    args = (x, w, b, rm, rv, float(momentum), float(eps), main.args[-1])
    with graph.inserting_before(origin):
        stats = graph.call_function(STATS, args)
    stats.meta["val"] = fake_call(STATS, args)
    with graph.inserting_before(stats.next):
        items = [graph.call_function(operator.getitem, (stats, i)) for i in range(5)]
        items += [graph.call_function(aten.select.int, (items[4], 0, i)) for i in range(2)]  # scale, shift
    for item, v in zip(items, [*stats.meta["val"], *stats.meta["val"][4]]):
        item.meta["val"] = v
    y = main.args[5][leaf.slot]
    for old in list(origin.users):  # (y, mean, invstd, running mean, running var): all but y from the stats op
        if old is not y:
            old.replace_all_uses_with(items[old.args[1] - 1])
    operands = list(main.args[5])
    operands[leaf.slot] = x
    extra = [epi.Operand(len(operands) + i, "c") for i in range(3)]
    operands += [items[0], items[5], items[6]]  # save_mean, scale, shift
    new = _substitute(tree, leaf, epi.Op("normalize", (leaf, *extra)))
    main.update_arg(5, operands)
    main.update_arg(6, str(new))
    main.meta["resfuse"]["sources"].append(origin.name)
    for n in [*dict.fromkeys([y, *origin.users]), origin]:
        if not n.users:
            graph.erase_node(n)
    return new


def _substitute(node: epi.Node, old: epi.Node, new: epi.Node) -> epi.Node:
    if node == old:
        return new
    if isinstance(node, epi.Op):
        return epi.Op(node.name, tuple(_substitute(a, old, new) for a in node.args), node.params)
    return node
