"""Merge the linear layers that read one input into one wider GEMM (attention's q, k and v projections).

Entry point: `merge_linears(gm, report) -> gm`, on the dynamo graph before aot_autograd, so that training's
backward is derived from the merged op: one data-gradient GEMM over the merged output's gradient instead of
one per layer plus the adds that summed them, and one weight-gradient GEMM.

Three [T, D] x [D, D] GEMMs become one [T, D] x [D, 3D]: wider tiles, one launch, one read of the input, and
the bias epilogue of all three in one kernel. The weights (and biases) are concatenated on every call, since
a compiled graph may not assume its parameters frozen: 3D x D elements, 3.5 MB for BERT-base's fp32 weights.
Each layer's output becomes a column slice of the merged output, a strided view that the reshapes attention
applies next accept as they are.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.amp import autocast_mode

LINEAR = (F.linear, torch._C._nn.linear)
# a merged op runs where the group's first linear ran: no grad or autocast mode may change up to its last one
MODE_SWITCHES = (autocast_mode._enter_autocast, autocast_mode._exit_autocast, torch._C._set_grad_enabled)


def _arg(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _value(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _group_key(node: fx.Node):
    """What linears must share to merge: the input node, and parameters of one kind (graph inputs, never
    computed in the graph, so they exist before the first linear), dtype, device and input width."""
    x, w, b = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")
    params = [p for p in (w, b) if p is not None]
    if not isinstance(_value(x), torch.Tensor) or not all(isinstance(p, fx.Node) and p.op in ("placeholder", "get_attr")
                                             for p in params):
        return None
    wv, bv = _value(w), _value(b)
    if not isinstance(wv, torch.Tensor) or wv.dim() != 2 or (b is not None and not isinstance(bv, torch.Tensor)):
        return None
    return x, b is not None, wv.shape[1], wv.dtype, wv.device


def merge_linears(gm: fx.GraphModule, report) -> fx.GraphModule:
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    groups: dict[tuple, list[fx.Node]] = {}
    for node in nodes:
        if node.op == "call_function" and node.target in LINEAR and (key := _group_key(node)) is not None:
            groups.setdefault(key, []).append(node)
    for (x, has_bias, _, _, _), linears in groups.items():
        if len(linears) < 2:
            continue
        span = nodes[order[linears[0]]:order[linears[-1]]]
        if any(n.op == "call_function" and n.target in MODE_SWITCHES for n in span):
            report.rewrites.append(f"linears on {x.name} not merged: a grad or autocast mode changes between them")
            continue
        widths = _merge(gm.graph, x, has_bias, linears)
        report.rewrites.append(f"{len(linears)} linears on {x.name} merged into one GEMM of {sum(widths)} outputs "
                               f"({'+'.join(map(str, widths))})")
    gm.graph.lint()
    gm.recompile()
    return gm


def _merge(graph: fx.Graph, x: fx.Node, has_bias: bool, linears: list[fx.Node]) -> list[int]:
    weights = [_arg(n, 1, "weight") for n in linears]
    widths = [_value(w).shape[0] for w in weights]
    with graph.inserting_before(linears[0]):
        weight = graph.call_function(torch.cat, (weights, 0))
        bias = graph.call_function(torch.cat, ([_arg(n, 2, "bias") for n in linears], 0)) if has_bias else None
        merged = graph.call_function(torch._C._nn.linear, (x, weight, bias))
        parts = graph.call_function(torch.split, (merged, widths, -1))
        outputs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(linears))]
    _example_values(x, weight, bias, merged, parts, outputs)
    for old, new in zip(linears, outputs):
        old.replace_all_uses_with(new)
        graph.erase_node(old)
    return widths


def _example_values(x, weight, bias, merged, parts, outputs) -> None:
    """Dynamo's example values for the new nodes, computed on the fake tensors the graph already holds."""
    wv = torch.cat([_value(w) for w in weight.args[0]], 0)
    weight.meta["example_value"] = wv
    bv = None
    if bias is not None:
        bias.meta["example_value"] = bv = torch.cat([_value(b) for b in bias.args[0]], 0)
    merged.meta["example_value"] = out = F.linear(_value(x), wv, bv)
    parts.meta["example_value"] = pieces = torch.split(out, parts.args[1], -1)
    for node, piece in zip(outputs, pieces):
        node.meta["example_value"] = piece
