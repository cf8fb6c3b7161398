"""FuseAddToOutput (OneFlow): a 2-input same-shape add is absorbed by the op producing one of its operands.

Entry point: `add_to_output(gm, ctx)`, the second pass. Producers that can accumulate into their output: our
fused conv/GEMM ops (the add joins the epilogue, the operand is read once in place of three passes over the
tensor: 3N bytes unfused, N fused), bare conv/mm/bmm anchors, training batch norm (forward) and the conv
data gradient (backward), and, with epilogue fusion off, mm as addmm(beta=1). A GEMM is also reached through
a linear layer's view, through an eval-mode dropout's clone of that view (T5's residual adds), and through
autocast's fp32 copy of its output (the op then stores fp32). The rules
(legality.py): the add is the producer's sole consumer, the producer has not already absorbed an add, the
other operand does not depend on the producer, has the output's shape, dtype (or the fp32 an add promotes
to) and strides, does not alias the producer's inputs, and nothing involved is mutated. Forward graphs try
the deeper producer first, backward graphs the later one (see add_to_output).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import epilogue as epi
from . import legality
from .group import MULTI_OUTPUT, Group, first_output_of, fused_op, signature
from .match_epilogue import LEFT, VIEWS, anchor_refusal, better_unfused, grow, is_anchor

aten = torch.ops.aten


def _gemm_behind_view(node) -> fx.Node | None:
    """The GEMM whose [M, N] output `node` re-batches to [B, S, N] (a linear layer's view), or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEWS):
        return None
    src = node.args[0]
    gemm = src.target in (aten.mm.default, aten.addmm.default) or (
        fused_op(src) is src and src.meta["resfuse"]["anchor"] == "gemm")
    if not (gemm and len(src.users) == 1):
        return None
    sv, v = legality.val(src), legality.val(node)
    if sv is None or v is None or sv.dim() != 2 or v.shape[-1] != sv.shape[-1] or not sv.is_contiguous():
        return None
    return None if legality.static_tensor(node) else src  # a view with a dynamic inner dim: not ours to write


def _cast_of(node) -> fx.Node | None:
    """The value that `node`, an fp16/bf16 -> fp32 `_to_copy` (autocast's), converts, or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target == aten._to_copy.default):
        return None
    src, kw, v = node.args[0], node.kwargs, legality.val(node.args[0])
    same_place = (kw.get("layout", torch.strided) == torch.strided and set(kw) <= {"dtype", "layout", "device"}
                  and v is not None and torch.device(kw.get("device", v.device)) == v.device)
    if not same_place or kw.get("dtype") != torch.float32 or len(src.users) != 1:
        return None
    return src if v.dtype in (torch.float16, torch.bfloat16) else None


def _clone_of(node) -> fx.Node | None:
    """The linear layer's view that `node`, a clone keeping its layout (eval-mode dropout), copies, or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target == aten.clone.default):
        return None
    src, v = node.args[0], legality.val(node)
    if _gemm_behind_view(src) is None or len(src.users) != 1 or v is None:
        return None
    return src if legality.same_strides(v, legality.val(src)) else None


def _refusal(producer, other: fx.Node, add: fx.Node) -> str | None:
    if not isinstance(producer, fx.Node) or producer.op != "call_function":
        return "not an op that can accumulate into its output"
    cast_of = _cast_of(producer)
    if cast_of is not None:  # the producer's fp32 copy: the producer stores fp32 itself
        return legality.first(legality.sole_consumer(producer), _refusal(cast_of, other, add))
    clone_of = _clone_of(producer)
    if clone_of is not None:  # a copy of the GEMM's view: the GEMM writes the add's result in its place
        return legality.first(legality.sole_consumer(producer), _refusal(clone_of, other, add))
    view_of = _gemm_behind_view(producer)
    if view_of is not None:
        return legality.first(_layout(other, producer, add), _refusal(view_of, other, add))
    if LEFT in producer.meta:  # match_epilogue tuned it and left it, with its bias, to Inductor
        return producer.meta[LEFT]
    fused = fused_op(producer)
    if fused is None and not is_anchor(producer):
        return f"{producer.target} cannot accumulate into its output"
    if fused is None:
        why = anchor_refusal(producer)
        if why:
            return why
    tree = epi.parse(signature(fused)) if fused is not None else None
    wrapped = producer not in add.args[:2]  # reached through a view or a cast, which were checked
    return legality.first(
        not wrapped and legality.sole_consumer(producer),
        tree is not None and epi.full_adds(tree) and "the producer has already absorbed an add",
        not wrapped and _layout(other, producer, add),
        _promotion_refusal(producer, add),
        legality.no_cycle(other, producer),
        legality.no_alias(other, producer.all_input_nodes),
        legality.no_mutation(producer, other, add),
    )


def _layout(other: fx.Node, producer: fx.Node, add: fx.Node) -> str | None:
    out = legality.val(producer)
    return legality.same_layout(other, out, torch.float32 if legality.promotes(add, out) else None)


def _promotion_refusal(producer: fx.Node, add: fx.Node) -> str | None:
    fused, origin = fused_op(producer), first_output_of(producer)
    if fused is not None:
        anchor = fused.meta["resfuse"]["anchor"]
    elif origin is not None:
        anchor = MULTI_OUTPUT[origin.target]
    else:
        anchor = "conv2d" if producer.target == aten.convolution.default else "gemm"
    if legality.promotes(add, legality.val(producer)) and anchor not in ("conv2d", "gemm"):
        return f"a mixed-precision add (fp32 result) into a {anchor} output is not supported"
    return None


def _absorb(producer: fx.Node, other: fx.Node, add: fx.Node, ctx) -> str | None:
    cast = clone = view = None
    if _cast_of(producer) is not None:
        cast, producer = producer, _cast_of(producer)
    if _clone_of(producer) is not None:
        clone, producer = producer, _clone_of(producer)
    if _gemm_behind_view(producer) is not None:
        view, producer = producer, _gemm_behind_view(producer)
    promoted = cast is not None or legality.promotes(add, legality.val(view if view is not None else producer))
    if producer.target == aten.mm.default and not ctx.config.fuse_epilogue and view is None and not promoted:
        with add.graph.inserting_before(add):
            new = add.graph.call_function(aten.addmm.default, (other, *producer.args[:2]))
        new.meta = dict(add.meta)
        add.replace_all_uses_with(new)
        add.graph.erase_node(add)
        add.graph.erase_node(producer)
        return None
    if fused_op(producer) is not None:
        g = Group.from_fused(producer)
    else:
        g = Group.from_anchor(producer, ctx.provider_for(producer))
    if view is not None:  # the GEMM writes the [B, S, N] view directly
        g.params = (legality.shape_param(legality.val(view).shape),)
        g.absorb(view, g.tree)
        producer = view
    if clone is not None:  # ... in the clone's place
        g.absorb(clone, g.tree)
        producer = clone
    if cast is not None:  # ... and in fp32
        g.absorb(cast, g.tree)
        producer = cast
    g.promoted = g.promoted or promoted
    why = g.aux_refusal(other)
    if why:
        return why
    leaf = g.operand(other, "full")
    g.absorb(add, epi.Op("add", (g.tree, leaf) if add.args[0] is producer else (leaf, g.tree)))
    if ctx.config.fuse_epilogue:
        grow(g, ctx)
    why = better_unfused(g, ctx)  # cuDNN/cuBLAS won: Inductor adds it in its consumer's kernel
    if why:
        return why
    emitted = g.emit()
    return emitted if isinstance(emitted, str) else None


def add_to_output(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    order, depth = {}, {}
    for i, n in enumerate(gm.graph.nodes):
        order[n] = i
        depth[n] = 1 + max((depth[a] for a in n.all_input_nodes), default=0)
    for add in list(gm.graph.nodes):
        if add.op != "call_function" or add.target != aten.add.Tensor:
            continue
        a, b = add.args[:2]
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            v = legality.val(a if isinstance(a, fx.Node) else b)
            counter = v is not None and not v.is_floating_point()
            ctx.reject(add, "adds a scalar to an integer tensor (a counter such as num_batches_tracked)" if counter
                       else "adds a scalar: an epilogue step, and no fused op reached it")
            continue
        if not ctx.config.fuse_add_to_output:
            ctx.reject(add, "fuse_add_to_output is off")
            continue
        if add.kwargs.get("alpha", 1) != 1:
            ctx.reject(add, f"add with alpha={add.kwargs['alpha']}")
            continue
        # Forward and inference: the deeper producer first (the main path of a residual block, not its
        # shortcut), then the later. Backward: the later first, so the fused op runs where the add was without
        # keeping the other producer's inputs alive until then (both sides are often dgrads there).
        if ctx.graph == "backward":
            sides = sorted([(a, b), (b, a)], key=lambda s: -order.get(s[0], -1))
        else:
            sides = sorted([(a, b), (b, a)], key=lambda s: (-depth.get(s[0], 0), -order.get(s[0], -1)))
        reasons = []
        for producer, other in sides:
            why = _refusal(producer, other, add) or _absorb(producer, other, add, ctx)
            if not why:
                break
            reasons.append(f"{producer.name}: {why}")
        else:
            ctx.reject(add, "; ".join(reasons))
    gm.graph.lint()
    gm.recompile()
    return gm
