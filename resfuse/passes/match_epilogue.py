"""Epilogue fusion pass: each conv/GEMM anchor absorbs its elementwise consumers while the legality rules allow.

Entry point: `match_epilogue(gm, ctx)`, the first fusion pass. `grow(group, ctx)` is shared with add_to_output.py,
which re-opens a fused op after absorbing an add so that the trailing activation follows it in.

Anchors: conv2d, mm/addmm/bmm, and in training graphs the output 0 of training batch norm (forward) and of
convolution_backward (the data gradient, backward). What an anchor absorbs (tables below): a per-channel
bias add, inference batch norm, the activations of UNARY, relu's gradient (threshold_backward), binary
add/sub/mul/div with a scalar, a per-channel or per-(n,c) vector, or (except add, which is
FuseAddToOutput's) a full tensor; gemm outputs may pass through a reshape that keeps the last dim, and any
chain through a layout-preserving clone (eval-mode dropout). A value that a conv/GEMM group computes and that
is read elsewhere as well (training's saved pre-activation) becomes the fused op's aux output (see grow).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .. import epilogue as epi
from . import legality
from .group import BN_TRAIN, CONV_BACKWARD, Group, first_output_of

aten = torch.ops.aten


def _arg(node: fx.Node, i: int, name: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _bound(v, unbounded: float) -> float:
    return unbounded if v is None else float(v)


# target -> (epilogue op name, params from the node)
UNARY = {
    aten.relu.default: lambda n: ("relu", ()),
    aten.hardtanh.default: lambda n: ("clamp", (float(_arg(n, 1, "min_val", -1.0)), float(_arg(n, 2, "max_val", 1.0)))),
    aten.clamp.default: lambda n: ("clamp", (_bound(_arg(n, 1, "min", None), -math.inf),
                                              _bound(_arg(n, 2, "max", None), math.inf))),
    aten.leaky_relu.default: lambda n: ("leaky_relu", (float(_arg(n, 1, "negative_slope", 0.01)),)),
    aten.gelu.default: lambda n: ("gelu_tanh" if n.kwargs.get("approximate", "none") == "tanh" else "gelu", ()),
    aten.silu.default: lambda n: ("silu", ()),
    aten.sigmoid.default: lambda n: ("sigmoid", ()),
    aten.hardswish.default: lambda n: ("hardswish", ()),
    aten.hardsigmoid.default: lambda n: ("hardsigmoid", ()),
    aten.tanh.default: lambda n: ("tanh", ()),
}
BINARY = {
    aten.add.Tensor: "add", aten.sub.Tensor: "sub", aten.mul.Tensor: "mul", aten.div.Tensor: "div",
    aten.add.Scalar: "add", aten.sub.Scalar: "sub", aten.mul.Scalar: "mul", aten.div.Scalar: "div",
}
BATCH_NORM = aten._native_batch_norm_legit_no_training.default
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
ANCHORS = (aten.convolution.default, aten.mm.default, aten.addmm.default, aten.bmm.default)


def is_anchor(node) -> bool:
    """Can a group start here: a conv/GEMM, or output 0 of training batch norm or of convolution_backward."""
    return isinstance(node, fx.Node) and node.op == "call_function" and (
        node.target in ANCHORS or (first_output_of(node) is not None and first_output_of(node).target in (
            BN_TRAIN, CONV_BACKWARD)))


def _training_refusal(origin: fx.Node) -> str | None:
    if origin.target == BN_TRAIN:
        x, _w, _b, mean, var, training = origin.args[:6]
        if mean is None or var is None:
            return "batch norm without running statistics"
        if not training:
            return "functional batch norm in eval mode"
        if legality.val(x) is not None and legality.val(x).dim() not in (2, 4):
            return f"{legality.val(x).dim()}-D batch norm input (2-D and 4-D only)"
        return legality.first(legality.static_tensor(x), legality.supported_dtype(x))
    grad_out, x, w = origin.args[:3]
    return legality.first(_conv_refusal(w, origin.args[7]), legality.static_tensor(grad_out),
                          legality.static_tensor(x), *[legality.supported_dtype(a) for a in (grad_out, w)])


def _conv_refusal(w: fx.Node, transposed: bool) -> str | None:
    """Convs and their data gradients may be grouped. A depthwise forward conv runs on our depthwise kernel; any
    other grouped conv, and every grouped data gradient, runs cuDNN and our epilogue kernel for the rest (our
    other conv and dgrad kernels are groups=1; the cudnn provider refuses grouped calls). Groups are implied by
    the shapes, so the fused ops take no argument for them."""
    if transposed:
        return "transposed convolution not supported"
    if legality.val(w) is not None and legality.val(w).dim() != 4:
        return f"{legality.val(w).dim() - 2}-D convolution not supported (2-D only)"
    return None


def anchor_refusal(node: fx.Node) -> str | None:
    """Why an anchor op can't start a group (None if it can)."""
    origin = first_output_of(node)
    if origin is not None:
        return _training_refusal(origin)
    if node.target == aten.convolution.default:
        why = _conv_refusal(node.args[1], node.args[6])
        if why:
            return why
    if node.target == aten.addmm.default and legality.static_tensor(node.args[0]) is None:
        kind, why = legality.broadcast_kind(node.args[0], legality.val(node), -1)
        if why:
            return f"addmm bias: {why}"
    return legality.first(legality.static_tensor(node), legality.supported_dtype(node),
                          *[legality.supported_dtype(a) for a in node.all_input_nodes])


def _step(g: Group, node: fx.Node, ctx) -> tuple | str | None:
    """How `node` (the sole consumer of g.out) joins the group: (tree, out, extra nodes), a refusal, or None
    when it is not an epilogue op at all."""
    t, cur = node.target, g.out
    if t in UNARY:
        name, params = UNARY[t](node)
        return epi.Op(name, (g.tree,), params), None, ()
    if t == aten.threshold_backward.default and node.args[0] is cur:
        kind, why = legality.broadcast_kind(node.args[1], g.out_val, g.channel_dim)
        why = why or legality.no_cycle(node.args[1], g.out) or _room_for(g, kind)
        if why:
            return why
        return epi.Op("threshold_bwd", (g.tree, g.operand(node.args[1], kind)), (float(node.args[2]),)), None, ()
    if t == BATCH_NORM and node.args[0] is cur:
        outs = [u for u in node.users if u.args[1] == 0]
        if len(outs) != 1 or any(u.users for u in node.users if u.args[1] != 0):
            return "batch norm's saved statistics are used"
        _, w, b, mean, var, _, eps = node.args[:7]
        vecs = [g.operand(v, "c") if v is not None else epi.Const(c) for v, c in ((mean, 0.0), (var, 1.0),
                                                                                  (w, 1.0), (b, 0.0))]
        return epi.Op("bn", (g.tree, *vecs), (float(eps),)), outs[0], tuple(node.users)
    if t in BINARY:
        name = BINARY[t]
        a, b = node.args[:2]
        if node.kwargs.get("alpha", 1) != 1:
            return f"{name} with alpha={node.kwargs['alpha']} not supported"
        other, chain_first = (b, True) if a is cur else (a, False)
        if other is cur:
            return f"{name} of the value with itself"
        if isinstance(other, fx.Node):
            kind, why = legality.broadcast_kind(other, g.out_val, g.channel_dim)
            why = why or legality.no_cycle(other, g.out) or legality.no_mutation(other)
            if why:
                return why
            if kind == "full" and name == "add":
                return None  # a same-shape add belongs to FuseAddToOutput
            why = _room_for(g, kind)
            if why:
                return why
            leaf = g.operand(other, kind)
        elif isinstance(other, (int, float)) and not isinstance(other, bool):
            leaf = epi.Const(float(other))
        else:
            return f"{name} with operand {other!r} not supported"
        return epi.Op(name, (g.tree, leaf) if chain_first else (leaf, g.tree)), None, ()
    if t == aten.clone.default and legality.same_strides(legality.val(node), g.out_val):
        return g.tree, None, ()  # eval-mode dropout: a copy that keeps the values and the layout
    if t in VIEWS and g.anchor == "gemm":
        shape = list(legality.val(node).shape)
        if (epi.aux_value(g.tree) is not None or g.out_val.dim() != 2 or len(shape) < 2 or shape[-1] != g.out_val.shape[-1]
                or not g.out_val.is_contiguous() or legality.static_tensor(node)):
            return None  # not a 2-D product's rows re-batched (a 1-D linear's [1, N] -> [N] is not; nor a dynamic inner dim)
        why = _rows_read(g, node)
        if why:
            return why
        g.params = (legality.shape_param(shape),)
        return g.tree, None, ()
    return None


def _rows_read(g: Group, view: fx.Node) -> str | None:
    """Why the group's product may not take the shape of `view`: an operand it already absorbed against the 2-D
    product (read row by row, as OPT's residual of [B*S, N] or Qwen2-MoE's [B*S, 1] gate) that does not broadcast
    to the view ([B, S, N] where B > 1); per-channel operands always do."""
    shape = tuple(legality.val(view).shape)
    for o in epi.operands(g.tree):
        if o.kind == "c":
            continue
        operand = g.operands[o.slot]
        v = legality.val(operand)
        if not all(isinstance(d, int) for d in (*v.shape, *shape)):
            return f"an operand read by rows, {tuple(v.shape)}, and a view of dynamic shape {shape}"
        _, why = legality.broadcast_kind(operand, legality.val(view), g.channel_dim)
        if why:
            return f"an operand read by the product's rows does not broadcast to its view ({why})"
    return None


def _room_for(g: Group, kind: str) -> str | None:
    if kind != "c" and sum(o.kind != "c" for o in epi.operands(g.tree)) >= legality.MAX_RESIDUALS:
        return f"more than {legality.MAX_RESIDUALS} residual operands"
    return None


def grow(g: Group, ctx) -> Group:
    """Absorb consumers into `g` until one is not an epilogue op or a rule refuses it.

    A value with several consumers stops the group, except once for a conv/GEMM whose value goes on into one
    activation and is also read elsewhere (a training graph saves the pre-activation for the activation's
    backward): that value becomes the op's aux output and the activation joins the epilogue."""
    while True:
        users = list(g.out.users)
        tree, n_operands, aux = g.tree, len(g.operands), (g.aux_node, g.aux_users)

        def undo():  # a refused step leaves the group as it was before it (no aux, no new operands)
            g.tree, (g.aux_node, g.aux_users) = tree, aux
            del g.operands[n_operands:]

        if len(users) != 1:
            node = _activation_to_save_for(g, users)
            if node is None:
                for u in users:
                    if u.target in UNARY or u.target in BINARY or u.target in (BATCH_NORM, aten.threshold_backward.default):
                        ctx.reject(u, legality.sole_consumer(g.out))
                return g
            g.save([u for u in users if u is not node])
        else:
            node = users[0]
        step = _step(g, node, ctx)
        if step is None:
            undo()
            return g
        why = step if isinstance(step, str) else legality.first(
            legality.static_tensor(step[1] or node), _same_dtype(g, step[1] or node),
            *[g.aux_refusal(o) for o in g.operands[n_operands:]])
        if why:
            undo()
            ctx.reject(node, why)
            return g
        g.absorb(node, *step)


def _activation_to_save_for(g: Group, users: list) -> fx.Node | None:
    """The one activation among a conv/GEMM value's consumers, when the value can become the aux output."""
    acts = [u for u in users if u.target in UNARY and u.args[0] is g.out]
    if g.anchor not in ("conv2d", "gemm") or len(acts) != 1 or epi.aux_value(g.tree) is not None or g.aux_users:
        return None
    return acts[0]


def _same_dtype(g: Group, node: fx.Node) -> str | None:
    v = legality.val(node)
    if v is not None and v.dtype != g.out_val.dtype:
        return f"changes dtype {g.out_val.dtype} -> {v.dtype}"
    return None


LEFT = "resfuse_left"  # node.meta key: why this pass left a conv/GEMM and its bias to Inductor


def _adds_alone(tree: epi.Node) -> bool:
    """Is the epilogue a residual add, with or without a bias, and nothing else (Inductor adds those in its
    consumer)?"""
    if tree == epi.ACC:
        return True
    return (isinstance(tree, epi.Op) and tree.name == "add" and sum(map(epi.contains_acc, tree.args)) == 1
            and all(_adds_alone(a) if epi.contains_acc(a) else isinstance(a, epi.Operand) and a.kind in ("c", "full")
                    for a in tree.args))


def better_unfused(g: Group, ctx) -> str | None:
    """Why a conv/GEMM whose epilogue is its bias alone (match_epilogue), or a residual add with or without the bias
    (add_to_output, switch leave_adds_to_inductor), stays ATen ops (None: fuse it).

    Where cuDNN/cuBLAS wins the op's tuning, our fused op runs it and then adds the bias in a kernel of its own,
    a pass over the output. Inductor, compiling the rest of the graph, adds a bias inside its consumer's kernel
    instead (ConvNeXt's depthwise conv, then a LayerNorm), and cuBLAS inside its GEMM; a residual add likewise (a
    transformer's next RMSNorm or LayerNorm). So the op is tuned now, on random inputs of its shapes (the fused
    call would find the same choice later), where Inductor takes the rest and every shape is static. Longer
    epilogues are not tried: add_to_output may still extend them, and Inductor writes a batch norm or an activation
    in a kernel of its own as we do (its stem batch norm and relu before the max-pool too:
    `bench/inductor_probe.py`)."""
    adds = epi.full_adds(g.tree) and ctx.config.leave_adds_to_inductor and _adds_alone(g.tree) and not g.promoted
    if not ctx.tune_now or not (g.tree == epi.LONE_BIAS or adds) or g.provider != "triton" \
            or g.anchor not in ("conv2d", "gemm"):
        return None
    vals = [legality.val(n) for n in (*g.inputs, *g.operands, g.out)]
    if any(v is None or not all(isinstance(d, int) for d in (*v.shape, *v.stride())) for v in vals):
        return None  # a dynamic batch: no inputs to tune on
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ..ops import fused
    from ..tuning.choose import choose

    with unset_fake_temporarily():
        rng = torch.Generator(legality.val(g.out).device).manual_seed(0)  # the user's RNG stream stays untouched

        def random(n):
            v = legality.val(n)
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).normal_(generator=rng)

        call = fused.call_of(g.anchor, tuple(random(n) for n in g.inputs), [random(n) for n in g.operands],
                             str(g.tree), g.params)
        provider = choose(call).provider
    if provider in ("epilogue", "aten"):
        what = "its residual add" if epi.full_adds(g.tree) else "its bias"
        return (f"an epilogue of {what} alone, where cuDNN/cuBLAS won the tuning ({provider}): left to Inductor, "
                "which adds it in its consumer's kernel")
    return None


def match_epilogue(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if not is_anchor(node):
            continue
        why = anchor_refusal(node)
        if why:
            ctx.reject(node, why)
            continue
        g = grow(Group.from_anchor(node, ctx.provider_for(node)), ctx)
        if g.tree == epi.ACC:
            continue  # no epilogue: leave the ATen op to cuDNN/cuBLAS (FuseAddToOutput may still take it)
        why = better_unfused(g, ctx)
        if why:
            node.meta[LEFT] = why
            ctx.reject(node, why)
            continue
        emitted = g.emit()
        if isinstance(emitted, str):
            ctx.reject(node, emitted)
    gm.graph.lint()
    gm.recompile()
    return gm
