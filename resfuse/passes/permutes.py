"""Sink the permute after a conv/GEMM below its elementwise consumers, so that they reach its epilogue.

Entry point: `sink_permutes(gm, ctx)`, the pass before match_epilogue. A ConvNeXt block ends in
`permute(linear(x)) * layer_scale + shortcut`: the permute (the NHWC product viewed as NCHW) stands between the
GEMM and the scale and residual add, so neither fusion pass could take them, and each ran as its own pass over
the activation. The rewrite, one consumer at a time:

    elementwise(permute(x, p), y)  =>  permute(elementwise(x, permute(y, p^-1)), p)

A `y` of lower rank is first unsqueezed to full rank; a permute of a permute that composes to the identity is
the original node. Only a permute of a conv/GEMM's value starts a chain (through elementwise ops, views and
eval-mode dropout's clone, each read once), and it must be read by that one consumer. The rewritten value must
keep the original's strides, so nothing downstream sees another layout. Elementwise ops choose their output's
layout from their inputs' strides, in the same way for permuted inputs, so in every case the property test
drew the strides matched; the check is a guard, and it also refuses a change of dtype.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import legality
from .group import fake_call
from .match_epilogue import ANCHORS, BINARY, UNARY, VIEWS

aten = torch.ops.aten
PERMUTE = aten.permute.default
CLONE = aten.clone.default  # eval-mode dropout: a copy that keeps the layout (with no memory_format given)


def _elementwise(node: fx.Node) -> bool:
    return node.op == "call_function" and not node.kwargs and (
        node.target in UNARY or node.target in BINARY or node.target is CLONE)


def _permutation(node: fx.Node) -> list[int]:
    v = legality.val(node.args[0])
    return [d % v.dim() for d in node.args[1]]


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _from_anchor(node: fx.Node) -> bool:
    """Is `node` a conv/GEMM's value, seen through elementwise ops (their full-shape input) and views?"""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in ANCHORS:
            return True
        if not _elementwise(node) and node.target not in VIEWS:
            return False
        if node.target in VIEWS or node.target is CLONE:
            inputs = node.args[:1]
        else:  # an elementwise op's inputs of its own shape (not a broadcast vector)
            shape = legality.val(node).shape if legality.val(node) is not None else None
            inputs = [a for a in node.args[:2] if legality.val(a) is not None and legality.val(a).shape == shape]
        if len(inputs) != 1 or len(inputs[0].users) != 1:
            return False  # a full-shape binary op has two candidate sources; a shared value is not ours to move
        node = inputs[0]
    return False


def _add(graph: fx.Graph, created: list, target, args: tuple) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = fake_call(target, args)
    created.append(node)
    return node


def _into_frame(graph: fx.Graph, created: list, y, inv: list[int]):
    """`y` as the unpermuted x sees it: a scalar stays, a lower-rank tensor is unsqueezed first."""
    if not isinstance(y, fx.Node):
        return y
    while legality.val(y).dim() < len(inv):
        y = _add(graph, created, aten.unsqueeze.default, (y, 0))
    if y.target is PERMUTE and _permutation(y) == _inverse(inv):
        return y.args[0]  # permute(permute(z, p), p^-1) is z
    return _add(graph, created, PERMUTE, (y, inv))


def _sink(permute: fx.Node) -> fx.Node | None:
    """Move `permute` below its consumer; returns the permute now after it, or None when the rule refuses."""
    users = list(permute.users)
    if len(users) != 1:
        return None
    user, x, p = users[0], permute.args[0], _permutation(permute)
    if not _elementwise(user):
        return None
    want, tensors = legality.val(user), [legality.val(a) for a in user.args if isinstance(a, fx.Node)]
    if (want is None or tuple(want.shape) != tuple(legality.val(permute).shape)
            or any(v is None or v.dim() > len(p) for v in tensors)):
        return None  # an operand that broadcasts the value larger, or one without metadata
    graph, inv, created = user.graph, _inverse(p), []
    with graph.inserting_before(user):
        args = tuple(x if a is permute else _into_frame(graph, created, a, inv) for a in user.args)
        outer = _add(graph, created, PERMUTE, (_add(graph, created, user.target, args), p))
    if not legality.same_strides(legality.val(outer), want) or legality.val(outer).dtype != want.dtype:
        for n in reversed(created):
            graph.erase_node(n)
        return None
    user.replace_all_uses_with(outer)
    graph.erase_node(user)
    graph.erase_node(permute)
    return outer


def sink_permutes(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if not (ctx.config.fuse_epilogue or ctx.config.fuse_add_to_output):
        return gm  # it only ever serves the fusions
    moved = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not PERMUTE or not _from_anchor(node.args[0]):
            continue
        while node is not None:
            node = _sink(node)
            moved += node is not None
    if moved:
        ctx.report.rewrites.append(f"{ctx.graph} graph: {moved} elementwise op(s) moved above a permute")
    gm.graph.lint()
    gm.recompile()
    return gm
