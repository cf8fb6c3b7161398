"""A fusion group under construction: one anchor, its epilogue tree, and the FX nodes it replaces.

Both passes grow groups the same way and emit them here: `Group.from_anchor` starts one at an aten conv/GEMM,
`Group.from_fused` reopens a resfuse op already in the graph, `absorb` adds a step, and `emit` replaces the
absorbed nodes by one call to a resfuse op (ops/). Training anchors have several outputs (batch norm's
statistics, convolution_backward's weight gradient): the group starts at their output 0, and emit rewires
or trims the rest. A conv/GEMM group whose value is also read elsewhere (the pre-activation a training graph
saves) keeps that value as an aux output (`save`), emitted as the op's _aux twin.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from .. import epilogue as epi
from . import legality

aten = torch.ops.aten
FUSED = {torch.ops.resfuse.conv2d.default: "conv2d", torch.ops.resfuse.gemm.default: "gemm",
         torch.ops.resfuse.batch_norm.default: "batch_norm", torch.ops.resfuse.conv2d_dgrad.default: "conv2d_dgrad"}
TARGET = {anchor: target for target, anchor in FUSED.items()}
# the ops for an epilogue with an aux node: they also return the value under it (ops/fused.py)
AUX_TARGET = {"conv2d": torch.ops.resfuse.conv2d_aux.default, "gemm": torch.ops.resfuse.gemm_aux.default}
FUSED.update({target: anchor for anchor, target in AUX_TARGET.items()})
SIGNATURE_ARG = {"conv2d": 3, "gemm": 3, "batch_norm": 6, "conv2d_dgrad": 3}
BN_TRAIN = aten._native_batch_norm_legit_functional.default
CONV_BACKWARD = aten.convolution_backward.default
# Ops with several outputs, whose first output is the one an epilogue extends. Their anchor node is the
# getitem(op, 0); `origin` is the op itself.
MULTI_OUTPUT = {BN_TRAIN: "batch_norm", CONV_BACKWARD: "conv2d_dgrad", torch.ops.resfuse.batch_norm.default: "batch_norm",
                **{target: anchor for anchor, target in AUX_TARGET.items()}}


def first_output_of(node: fx.Node) -> fx.Node | None:
    """The multi-output op whose output 0 `node` is, or None."""
    if (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and node.args[1] == 0 and isinstance(node.args[0], fx.Node) and node.args[0].target in MULTI_OUTPUT):
        return node.args[0]
    return None


def fused_op(node: fx.Node) -> fx.Node | None:
    """The resfuse op that computes `node`'s value (itself, or through getitem 0), or None."""
    if not isinstance(node, fx.Node):
        return None
    origin = first_output_of(node)
    target = origin.target if origin is not None else node.target
    if target not in FUSED:
        return None
    return origin if origin is not None else node


def signature(fused: fx.Node) -> str:
    return fused.args[SIGNATURE_ARG[FUSED[fused.target]]]


@dataclasses.dataclass
class Group:
    anchor: str  # "conv2d" | "gemm" | "batch_norm" | "conv2d_dgrad"
    inputs: tuple  # (x, weight), (a, b), (x, weight, bias, running_mean, running_var) or (grad_out, weight)
    params: tuple  # conv: (stride, padding, dilation); gemm: (out_shape,); batch_norm: (momentum, eps);
    #                conv2d_dgrad: (input_shape, stride, padding, dilation)
    tree: epi.Node
    operands: list  # fx.Nodes, in slot order
    sources: list  # names of the original nodes, anchor first
    out: fx.Node  # the node whose value the group computes so far
    replaced: list  # nodes to erase once the fused op is in place
    provider: str = "aten"
    origin: fx.Node | None = None  # the multi-output op whose output 0 is the group's start (MULTI_OUTPUT)
    promoted: bool = False  # stores fp32 from fp16/bf16 inputs (a mixed-precision add was absorbed)
    aux_users: list = dataclasses.field(default_factory=list)  # the nodes that read the aux output
    aux_node: fx.Node | None = None  # the graph node whose value the aux output replaces (a fresh aux only)

    @property
    def channel_dim(self) -> int:
        return -1 if self.anchor == "gemm" else 1

    @property
    def out_val(self) -> torch.Tensor:
        return legality.val(self.out)

    def operand(self, node: fx.Node, kind: str) -> epi.Operand:
        if node in self.operands:
            slot = self.operands.index(node)
        else:
            slot = len(self.operands)
            self.operands.append(node)
        return epi.Operand(slot, kind)

    def save(self, users: list) -> None:
        """The value so far becomes the aux output (training saves it), read by `users` instead of g.out."""
        self.tree = epi.Op("aux", (self.tree,))
        self.aux_node, self.aux_users = self.out, list(users)

    def aux_refusal(self, operand: fx.Node) -> str | None:
        """With an aux output, the op must run before the aux's readers, so an operand absorbed after the aux
        must already exist by then (which also rules out a cycle through them)."""
        if not self.aux_users or not isinstance(operand, fx.Node):
            return None
        source = self.aux_node if self.aux_node is not None else self.origin  # the value, or the op returning it
        if source is not None and legality.depends_on(operand, source):
            return f"operand {operand.name} is computed from the saved pre-activation (a cycle)"
        order = {n: i for i, n in enumerate(operand.graph.nodes)}
        first = min(self.aux_users, key=order.__getitem__)
        if order[operand] >= order[first]:  # itself a reader, or after one
            return f"operand {operand.name} is or follows {first.name}, which reads the saved pre-activation"
        return None

    def absorb(self, node: fx.Node, tree: epi.Node, out: fx.Node | None = None, extra: tuple = ()) -> None:
        """Take `node` (and `extra` helper nodes such as BN's getitem) into the group."""
        self.tree = tree
        self.sources.append(node.name)
        self.replaced += [self.out, node, *extra]
        self.out = out or node

    @classmethod
    def from_anchor(cls, node: fx.Node, provider: str) -> "Group":
        origin = first_output_of(node)
        if origin is not None and origin.target == BN_TRAIN:
            x, w, b, mean, var, _training, momentum, eps = origin.args[:8]
            return cls("batch_norm", (x, w, b, mean, var), (float(momentum), float(eps)), epi.ACC, [],
                       [origin.name], node, [], provider, origin)
        if origin is not None and origin.target == CONV_BACKWARD:
            grad_out, x, w, _bias_sizes, stride, padding, dilation = origin.args[:7]
            params = (legality.shape_param(legality.val(x).shape), list(stride), list(padding), list(dilation))
            return cls("conv2d_dgrad", (grad_out, w), params, epi.ACC, [], [origin.name], node, [], provider,
                       origin)
        t = node.target
        if t == aten.convolution.default:
            x, w, bias, stride, padding, dilation = node.args[:6]
            g = cls("conv2d", (x, w), (list(stride), list(padding), list(dilation)), epi.ACC, [], [node.name],
                    node, [], provider)
            if bias is not None:
                g.tree = epi.Op("add", (epi.ACC, g.operand(bias, "c")))
            return g
        if t in (aten.mm.default, aten.bmm.default):
            a, b = node.args[:2]
            return cls("gemm", (a, b), (legality.shape_param(legality.val(node).shape),), epi.ACC, [], [node.name],
                       node, [], provider)
        if t == aten.addmm.default:
            bias, a, b = node.args[:3]
            beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
            g = cls("gemm", (a, b), (legality.shape_param(legality.val(node).shape),), epi.ACC, [], [node.name],
                    node, [], provider)
            kind, _ = legality.broadcast_kind(bias, legality.val(node), -1)
            acc = epi.ACC if alpha == 1 else epi.Op("mul", (epi.ACC, epi.Const(float(alpha))))
            b_op = g.operand(bias, kind)
            b_term = b_op if beta == 1 else epi.Op("mul", (b_op, epi.Const(float(beta))))
            g.tree = epi.Op("add", (acc, b_term))
            return g
        raise ValueError(f"{node.format_node()} is not an anchor")

    @classmethod
    def from_fused(cls, node: fx.Node) -> "Group":
        """Reopen the fused op computing `node` (the op itself, or getitem 0 of a multi-output one)."""
        fused = fused_op(node)
        anchor = FUSED[fused.target]
        n_inputs = {"conv2d": 2, "gemm": 2, "batch_norm": 5, "conv2d_dgrad": 2}[anchor]
        inputs, operands, sig = fused.args[:n_inputs], fused.args[n_inputs], fused.args[n_inputs + 1]
        params, provider = tuple(fused.args[n_inputs + 2:-1]), fused.args[-1]
        origin = fused if fused is not node else None
        tree = epi.parse(sig)
        aux_users = [u for item in fused.users if item.target is operator.getitem and item.args[1] == 1
                     for u in item.users] if fused.target in AUX_TARGET.values() else []
        return cls(anchor, tuple(inputs), params, epi.without_cast(tree), list(operands),
                   list(fused.meta["resfuse"]["sources"]), node, [], provider, origin,
                   promoted=epi.out_dtype(tree, None) is not None, aux_users=aux_users)

    def ops(self) -> list[str]:
        return epi.pattern_ops(self.tree)

    def emit(self) -> fx.Node | str:
        """Put the fused op in the graph in place of the group; returns the new node, or why it can't."""
        graph, last = self.out.graph, self.out
        tree = epi.Op("float32", (self.tree,)) if self.promoted else self.tree
        args = (*self.inputs, list(self.operands), str(tree), *self.params, self.provider)
        aux = epi.aux_value(tree) is not None
        target = AUX_TARGET[self.anchor] if aux else TARGET[self.anchor]
        fake = fake_call(target, args)
        value = fake[0] if isinstance(fake, tuple) else fake
        want = self.out_val
        if not legality.same_strides(value, want):
            return f"fused output strides {value.stride()} differ from the graph's {want.stride()}"
        saved = legality.val(self.aux_node) if self.aux_node is not None else None
        if saved is not None and (tuple(fake[1].shape) != tuple(saved.shape) or fake[1].dtype != saved.dtype
                                  or not legality.same_strides(fake[1], saved)):
            return (f"aux output {tuple(fake[1].shape)} {fake[1].dtype} {fake[1].stride()} differs from the saved "
                    f"value {tuple(saved.shape)} {saved.dtype} {saved.stride()}")
        with graph.inserting_before(last):
            new = graph.call_function(target, args)
        new.meta["val"] = fake
        new.meta["resfuse"] = {"anchor": self.anchor, "sources": list(self.sources)}
        result = new
        if isinstance(fake, tuple):
            result = self._rewire_outputs(new, fake)
        elif self.origin is not None and self.origin.target == CONV_BACKWARD:
            self._weight_gradient_only()
        if self.aux_node is not None:  # a fresh aux output: the saved value's other readers now read it
            aux_item = next(u for u in new.users if u.target is operator.getitem and u.args[1] == 1)
            readers = set(self.aux_users)
            self.aux_node.replace_all_uses_with(aux_item, delete_user_cb=readers.__contains__)
        last.replace_all_uses_with(result)
        stale = [*self.replaced, last]
        if self.origin is not None:  # erased last (the list is walked backwards), after its getitems
            stale = [self.origin, *stale, *self.origin.users]
        for n in reversed(list(dict.fromkeys(stale))):
            if n not in (new, result) and not n.users:
                graph.erase_node(n)
        _keep_topological(graph, new)
        return new

    def _rewire_outputs(self, new: fx.Node, fake: tuple) -> fx.Node:
        """getitem nodes for each output of `new`; the origin's outputs other than 0 now come from them."""
        graph = new.graph
        items = []
        with graph.inserting_after(new):
            for i in reversed(range(len(fake))):
                item = graph.call_function(operator.getitem, (new, i))
                item.meta["val"] = fake[i]
                items.insert(0, item)
        for old in list(self.origin.users) if self.origin is not None else []:
            if old.target is operator.getitem and old.args[1] != 0:
                old.replace_all_uses_with(items[old.args[1]])
        return items[0]

    def _weight_gradient_only(self) -> None:
        """The origin convolution_backward keeps the gradients other than the input's (we compute that)."""
        mask = list(self.origin.args[10])
        mask[0] = False
        self.origin.update_arg(10, mask)
        val = self.origin.meta.get("val")
        if isinstance(val, tuple):
            self.origin.meta["val"] = (None, *val[1:])


def _keep_topological(graph: fx.Graph, new: fx.Node) -> None:
    """The fused op sits where the group's last node was. When an output is used before that (batch norm's
    statistics, by the running-stat copies), move the op and its getitems up to just after its last input. Readers
    still before them (the new running statistics cast back to fp16/bf16 buffers, where the op's last input is a
    residual computed later than the batch norm), and whatever reads those before them, move down to just after."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    items = [u for u in new.users if u.target is operator.getitem]
    if all(order[u] > order[new] for n in [new, *items] for u in n.users):
        return
    anchor = max(new.all_input_nodes, key=order.__getitem__)
    for n in reversed([new, *sorted(items, key=order.__getitem__)]):
        anchor.append(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    outputs = [new, *items]
    tail = max(outputs, key=order.__getitem__)
    early, stack = set(), [u for n in outputs for u in n.users if order[u] < order[tail] and u not in outputs]
    while stack:
        u = stack.pop()
        if u not in early:
            if legality.mutates(u):
                raise NotImplementedError(f"{u.name} writes in place and would move past {new.name}'s inputs")
            early.add(u)
            stack += [v for v in u.users if order[v] < order[tail]]
    for u in sorted(early, key=order.__getitem__, reverse=True):
        tail.append(u)


def fake_call(target, args):
    """Run the op's fake implementation on the nodes' fake values (metadata only)."""
    from torch._guards import detect_fake_mode
    from torch.utils._pytree import tree_leaves

    mode = detect_fake_mode([legality.val(a) for a in tree_leaves(args) if legality.val(a) is not None])
    real = fx.node.map_arg(args, lambda n: n.meta["val"])
    with mode:
        return target(*real)
