"""Two fused 1x1 convs, the second reading the first's output, become one resfuse::conv2d_chain (ops/chain.py).

Entry point: `chain_convs(gm, ctx)`, an inference pass after the fusions (its convs are their fused ops; a
bottleneck's tail conv has absorbed the residual add and relu by then). The pair it looks for:

    y = resfuse.conv2d(x, w1, ...)    1x1, stride 1, unpadded, on a channels_last fp16/bf16 x
    z = resfuse.conv2d(y, w2, ...)    1x1, stride 1, unpadded
    => y, z = resfuse.conv2d_chain(x, w1, ..., w2, ...)

y may have other readers (the next block's residual add, a downsampling shortcut): it is still written, only
not read back by the second conv. A conv is in one pair at most; each tail takes its first eligible reader.
The chain op sits where the first conv was, so the second's other arguments (its weight and epilogue operands)
must already be computed there. Each rewrite is listed as a fusion (anchor conv2d_chain); a refusal says why.
The tuner keeps the chain kernel only where it measures faster than the two convs as two ops.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ops import chain as op
from . import legality
from .group import TARGET, fake_call, signature

CONV = TARGET["conv2d"]
CHAIN = torch.ops.resfuse.conv2d_chain.default


def chain_convs(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if ctx.graph != "inference" or not ctx.config.chain_convs:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    taken: set[fx.Node] = set()
    done = 0
    for head in list(gm.graph.nodes):
        if head.op != "call_function" or head.target != CONV or head in taken:
            continue
        tail = head.args[0]
        if not (isinstance(tail, fx.Node) and tail.target == CONV and tail not in taken and tail.args[-1] == "triton"
                and _pointwise(tail) and _pointwise(head)):
            continue
        why = _refusal(tail, head, order)
        if why:
            ctx.reject(head, f"not chained with {tail.name}: {why}")
            continue
        _rewrite(gm.graph, tail, head)
        taken |= {tail, head}
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return gm


def _pointwise(conv: fx.Node) -> bool:
    """A 1x1 conv of stride 1, unpadded: a GEMM over pixels, what the chain kernel runs (the pairs it looks at)."""
    w = legality.val(conv.args[1])
    return (w is not None and tuple(w.shape[2:]) == (1, 1)
            and [list(a) for a in conv.args[4:7]] == [list(a) for a in op.ONE])


def _refusal(tail: fx.Node, head: fx.Node, order: dict) -> str | None:
    why = op.signature_refusal(signature(tail)) or op.signature_refusal(signature(head))
    if why:
        return why
    from ..kernels import chain as kernel  # here: importing the kernels builds Triton helpers, which must wait
    #                                         for the interpreter switch (kernels.set_options)

    x, w1, w2 = (legality.val(n) for n in (tail.args[0], tail.args[1], head.args[1]))
    why = legality.static_tensor(tail.args[0]) or kernel.refusal(x, w1, w2)
    if why:
        return why
    later = [a for a in head.all_input_nodes if a is not tail and order[a] > order[tail]]
    if later:
        return f"the second conv reads {later[0].name}, computed after the first conv"
    fake = fake_call(CHAIN, _args(tail, head))
    if not all(legality.same_strides(f, legality.val(n)) for f, n in zip(fake, (tail, head))):
        return "the chain's output layout differs from the convs'"
    return None


def _args(tail: fx.Node, head: fx.Node) -> tuple:
    x, w1, ops1, sig1 = tail.args[:4]
    _, w2, ops2, sig2 = head.args[:4]
    return (x, w1, ops1, sig1, w2, ops2, sig2, tail.args[-1])


def _rewrite(graph: fx.Graph, tail: fx.Node, head: fx.Node) -> None:
    with graph.inserting_before(tail):
        node = graph.call_function(CHAIN, _args(tail, head))
        node.meta["val"] = fake_call(CHAIN, node.args)
        y = graph.call_function(operator.getitem, (node, 0))
        z = graph.call_function(operator.getitem, (node, 1))
    y.meta["val"], z.meta["val"] = node.meta["val"]
    info = tail.meta["resfuse"], head.meta["resfuse"]
    node.meta["resfuse"] = {"anchor": "conv2d_chain", "sources": [*info[0]["sources"], *info[1]["sources"]],
                            "signature": f"{signature(tail)};{signature(head)}"}
    head.replace_all_uses_with(z)
    graph.erase_node(head)
    tail.replace_all_uses_with(y)
    graph.erase_node(tail)
