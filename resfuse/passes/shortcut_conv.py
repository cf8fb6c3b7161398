"""A residual block's shortcut conv, computed inside the block's last conv: one resfuse::conv2d_shortcut (ops/shortcut.py).

Entry point: `shortcut_convs(gm, ctx)`, an inference pass after the fusions (FuseAddToOutput has made the
shortcut's output a full operand of the last conv's epilogue by then). The pair it looks for, a downsampling
bottleneck's end:

    r = resfuse.conv2d(x, w2, ...)                      1x1, any stride, unpadded: the shortcut conv + batch norm
    z = resfuse.conv2d(y, w1, [..., r, ...], ...)       1x1, stride 1, unpadded: relu(add(bn(acc), r))
    => z = resfuse.conv2d_shortcut(y, w1, [...], ..., slot of r, x, w2, ..., stride)

r must have no other reader: it is never written. The new op sits where the last conv was; the shortcut's
arguments come before r, so they are computed there. x lives until then instead of r: the same size at stride 1,
twice r's at stride 2 where r has twice x's channels (ResNet's). Each rewrite is listed as a fusion (anchor
conv2d_shortcut); a refusal says why. The tuner keeps our kernel only where it measures faster than the two convs.
Runs before chain_convs, which would otherwise pair the last conv with the next block's first.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import epilogue as epi
from ..ops import chain as chain_op
from . import legality
from .group import TARGET, fake_call, signature

CONV = TARGET["conv2d"]
SHORTCUT = torch.ops.resfuse.conv2d_shortcut.default
ONE, UNPADDED = [[1, 1], [0, 0], [1, 1]], [[0, 0], [1, 1]]


def shortcut_convs(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if ctx.graph != "inference" or not ctx.config.shortcut_convs:
        return gm
    done = 0
    for main in list(gm.graph.nodes):
        if main.op != "call_function" or main.target != CONV or main.args[-1] != "triton":
            continue
        for slot, short in _residual_convs(main):
            why = _refusal(main, slot, short)
            if why:
                ctx.reject(short, f"not computed inside {main.name}: {why}")
                continue
            _rewrite(gm.graph, main, slot, short)
            done += 1
            break
    if done:
        gm.graph.lint()
        gm.recompile()
    return gm


def _residual_convs(main: fx.Node) -> list[tuple[int, fx.Node]]:
    """(slot, node) of each full operand of main's epilogue that a fused conv of ours produces (an "nc" one at 1x1
    pixels, where the residual has no rows to broadcast over)."""
    operands = main.args[2]
    return [(o.slot, operands[o.slot]) for o in epi.operands(epi.parse(signature(main)))
            if o.kind in ("full", "nc") and isinstance(operands[o.slot], fx.Node) and operands[o.slot].target == CONV
            and operands[o.slot].args[-1] == "triton"]


def _refusal(main: fx.Node, slot: int, short: fx.Node) -> str | None:
    if len(short.users) != 1:
        return f"{short.name} has other readers, so it is written anyway"
    if [list(a) for a in main.args[4:7]] != ONE:
        return "the main conv is not 1x1 stride 1 unpadded"
    if [list(a) for a in short.args[5:7]] != UNPADDED:
        return "the shortcut conv is padded or dilated"
    why = chain_op.signature_refusal(signature(main)) or chain_op.signature_refusal(signature(short))
    if why:
        return why
    from ..kernels import shortcut as kernel  # here: importing the kernels builds Triton helpers, which must wait
    #                                            for the interpreter switch (kernels.set_options)

    y, w1, x, w2 = (legality.val(n) for n in (main.args[0], main.args[1], short.args[0], short.args[1]))
    why = (legality.static_tensor(main.args[0]) or legality.static_tensor(short.args[0])
           or kernel.refusal(y, w1, x, w2, list(short.args[4])))
    if why:
        return why
    if not legality.same_strides(fake_call(SHORTCUT, _args(main, slot, short)), legality.val(main)):
        return "the op's output layout differs from the conv's"
    return None


def _args(main: fx.Node, slot: int, short: fx.Node) -> tuple:
    y, w1, ops1, sig1 = main.args[:4]
    x, w2, ops2, sig2, stride = short.args[:5]
    return (y, w1, [*ops1[:slot], *ops1[slot + 1:]], sig1, slot, x, w2, ops2, sig2, stride, main.args[-1])


def _rewrite(graph: fx.Graph, main: fx.Node, slot: int, short: fx.Node) -> None:
    with graph.inserting_before(main):
        node = graph.call_function(SHORTCUT, _args(main, slot, short))
    node.meta["val"] = fake_call(SHORTCUT, node.args)
    info = main.meta["resfuse"], short.meta["resfuse"]
    node.meta["resfuse"] = {"anchor": "conv2d_shortcut", "sources": [*info[1]["sources"], *info[0]["sources"]],
                            "signature": f"{signature(main)};{signature(short)}"}
    main.replace_all_uses_with(node)
    graph.erase_node(main)
    graph.erase_node(short)
