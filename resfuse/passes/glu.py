"""Gated linear units (SwiGLU, GeGLU, ReGLU) as one GEMM whose epilogue pairs the gate's and the up's columns.

Entry point: `glu_linears(gm, ctx)`, on inference graphs, before match_epilogue. A transformer's gated MLP (Llama,
Mistral, Qwen, Gemma, T5 v1.1, Phi-3) computes act(x @ Wg^T) * (x @ Wu^T). merge_linears has already made the two
projections one GEMM whose output is split in halves (Phi-3 and diffusers' GEGLU write it that way themselves):

    p = mm(x, W^T) [T, 2I];  g, u = split(p, [I, I], -1);  y = act(g) * u

Unfused, the [T, 2I] product is written and read back, and the activation and the product are two more passes
over I columns. Here the weight's rows are interleaved, gate row j then up row j, so each output channel's two
values sit in adjacent columns of one accumulator tile, and one `resfuse::gemm` computes y with the epilogue
mul(act(acc), up) (epilogue.paired; kernels/codegen._pairing): the product never leaves the registers. The
interleaved weight is computed from the parameters alone, so capture/constants.py hoists it out of the graph.

Rules: the product is a 2-D mm (no bias: addmm's would pair the bias too) whose value is read only by the split,
possibly through one view that keeps its last dim; two halves of equal width along the last dim, each read once;
one half through a unary activation that match_epilogue fuses, the other into a same-shape, same-dtype mul with it.
Consumers after the mul then join the epilogue as they would any GEMM's (match_epilogue.grow).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import epilogue as epi
from . import legality
from .group import Group, fake_call
from .match_epilogue import UNARY, VIEWS, grow

aten = torch.ops.aten
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


def glu_linears(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if ctx.graph != "inference" or not ctx.config.fuse_epilogue or not ctx.config.fuse_glu:
        return gm
    for mul in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.mul.Tensor]:
        found = _match(mul)
        if found is None:
            continue
        if isinstance(found, str):
            ctx.reject(mul, found)
            continue
        product, split, act_first, act = found
        g = _group(product, split, act_first, act, mul, ctx)
        emitted = grow(g, ctx).emit()
        if isinstance(emitted, str):
            ctx.reject(mul, emitted)
    gm.graph.lint()
    gm.recompile()
    return gm


def _match(mul: fx.Node):
    """(the mm, the split, whether the activated half is the first, the activation node), a refusal where the mul is
    a GLU's that cannot fuse, or None where it is no GLU."""
    a, b = mul.args[:2]
    for act in [n for n in (a, b) if isinstance(n, fx.Node) and n.target in UNARY]:
        other = b if act is a else a
        half, rest = _half(act.args[0]), _half(other)
        if half is None or rest is None or half[0] is not rest[0] or half[1] == rest[1]:
            continue
        split = half[0]
        source = split.args[0]
        product = source.args[0] if source.target in VIEWS else source
        if not isinstance(product, fx.Node) or product.target != aten.mm.default:
            return None
        why = legality.first(
            *map(legality.sole_consumer, (act, act.args[0], other, source, *[product] * (product is not source))),
            None if len(split.users) == 2 else f"{split.name} has {len(split.users)} consumers",
            legality.static_tensor(product), legality.static_tensor(mul), legality.supported_dtype(product),
            None if _same(mul, act) and _same(mul, other) else "the mul broadcasts or changes dtype")
        if why:
            return f"GLU not fused: {why}"
        return product, split, half[1] == 0, act
    return None


def _same(mul: fx.Node, x: fx.Node) -> bool:
    m, v = legality.val(mul), legality.val(x)
    return m is not None and v is not None and m.shape == v.shape and m.dtype == v.dtype


def _half(node) -> tuple[fx.Node, int] | None:
    """(the split, 0 or 1) where `node` is the first or second of two equal halves of a value's last dim."""
    if not (isinstance(node, fx.Node) and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and node.args[0].target in SPLITS):
        return None
    split = node.args[0]
    source, sizes = split.args[0], split.args[1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    v = legality.val(source)
    if v is None or dim not in (-1, v.dim() - 1) or not isinstance(v.shape[-1], int) or v.shape[-1] % 2:
        return None
    width = v.shape[-1] // 2
    if sizes not in (width, [width, width]):
        return None
    return split, node.args[1]


def _group(product: fx.Node, split: fx.Node, act_first: bool, act: fx.Node, mul: fx.Node, ctx) -> Group:
    """The fused op's group: the mm's inputs with the weight interleaved, the epilogue act(acc) * up."""
    x, b = product.args[:2]
    name, params = UNARY[act.target](act)
    gate = epi.Op(name, (epi.ACC,), params)
    tree = epi.Op("mul", (gate, epi.UP) if mul.args[0] is act else (epi.UP, gate))
    with product.graph.inserting_before(product):
        b_paired = _interleaved(product.graph, b, act_first)
    g = Group("gemm", (x, b_paired), (legality.shape_param(legality.val(mul).shape),), tree, [],
              [product.name, act.name, mul.name], mul, [], ctx.provider_for(product))
    g.replaced = list(dict.fromkeys([product, split.args[0], split, *split.users, act]))  # erased in reverse
    return g


def _interleaved(graph: fx.Graph, b: fx.Node, act_first: bool) -> fx.Node:
    """B [K, 2I] with its columns reordered activated half's j, other half's j, for each j: as the [2I, K] weight
    W = B^T, stack((W[:I], W[I:]), 1).view(2I, K), transposed back (the activated half first)."""
    k, n = legality.val(b).shape
    w = _call(graph, aten.permute.default, b, [1, 0])
    first, second = (_call(graph, aten.slice.Tensor, w, 0, lo, lo + n // 2) for lo in (0, n // 2))
    if not act_first:
        first, second = second, first
    stacked = _call(graph, aten.stack.default, [first, second], 1)
    return _call(graph, aten.permute.default, _call(graph, aten.view.default, stacked, [n, k]), [1, 0])


def _call(graph: fx.Graph, target, *args) -> fx.Node:
    """A new node and its fake value, computed on its inputs' fake values."""
    node = graph.call_function(target, args)
    node.meta["val"] = fake_call(target, args)
    return node
