"""Convolutions' list arguments written out for every spatial dim: the first pass.

Entry point: `full_conv_args(gm, ctx)`. ATen takes one value for all of a conv's spatial dims in its stride,
padding, dilation and output padding (`nn.Conv2d(padding="valid")` traces to padding=[0]); the passes after this
one, the fused ops and their kernels read one value a dim. Written out here, the rule lives in one place. The conv
computes the same either way.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

# each op's weight slot, and the slots of its per-dim lists: stride, padding, dilation, output_padding
LISTS = {aten.convolution.default: (1, (3, 4, 5, 7)), aten.convolution_backward.default: (2, (4, 5, 6, 8))}


def full_conv_args(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in LISTS:
            continue
        weight, slots = LISTS[node.target]
        dims = node.args[weight].meta["val"].dim() - 2
        args = list(node.args)
        for slot in slots:
            if len(args[slot]) == 1 and dims > 1:
                args[slot] = list(args[slot]) * dims
                changed = True
        node.args = tuple(args)
    if changed:
        gm.recompile()
    return gm
