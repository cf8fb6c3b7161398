"""A fusion group under construction: one anchor, its epilogue tree, and the FX nodes it replaces.

Both passes grow groups the same way and emit them here: `Group.from_anchor` starts one at an aten conv/GEMM,
`Group.from_fused` reopens a resfuse op already in the graph, `absorb` adds a step, and `emit` replaces the
absorbed nodes by one call to resfuse::conv2d / resfuse::gemm.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import epilogue as epi
from . import legality

aten = torch.ops.aten
FUSED = {torch.ops.resfuse.conv2d.default: "conv2d", torch.ops.resfuse.gemm.default: "gemm"}


@dataclasses.dataclass
class Group:
    anchor: str  # "conv2d" | "gemm"
    inputs: tuple  # (x, weight) or (a, b)
    params: tuple  # conv: (stride, padding, dilation); gemm: (out_shape,)
    tree: epi.Node
    operands: list  # fx.Nodes, in slot order
    sources: list  # names of the original nodes, anchor first
    out: fx.Node  # the node whose value the group computes so far
    replaced: list  # nodes to erase once the fused op is in place
    provider: str = "aten"

    @property
    def channel_dim(self) -> int:
        return 1 if self.anchor == "conv2d" else -1

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

    def absorb(self, node: fx.Node, tree: epi.Node, out: fx.Node | None = None, extra: tuple = ()) -> None:
        """Take `node` (and `extra` helper nodes such as BN's getitem) into the group."""
        self.tree = tree
        self.sources.append(node.name)
        self.replaced += [self.out, node, *extra]
        self.out = out or node

    @classmethod
    def from_anchor(cls, node: fx.Node, provider: str) -> "Group":
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
            return cls("gemm", (a, b), (list(legality.val(node).shape),), epi.ACC, [], [node.name], node, [],
                       provider)
        if t == aten.addmm.default:
            bias, a, b = node.args[:3]
            beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
            g = cls("gemm", (a, b), (list(legality.val(node).shape),), epi.ACC, [], [node.name], node, [], provider)
            kind, _ = legality.broadcast_kind(bias, legality.val(node), -1)
            acc = epi.ACC if alpha == 1 else epi.Op("mul", (epi.ACC, epi.Const(float(alpha))))
            b_op = g.operand(bias, kind)
            b_term = b_op if beta == 1 else epi.Op("mul", (b_op, epi.Const(float(beta))))
            g.tree = epi.Op("add", (acc, b_term))
            return g
        raise ValueError(f"{node.format_node()} is not an anchor")

    @classmethod
    def from_fused(cls, node: fx.Node) -> "Group":
        anchor = FUSED[node.target]
        if anchor == "conv2d":
            x, w, operands, sig, stride, padding, dilation, provider = node.args
            params = (stride, padding, dilation)
            inputs = (x, w)
        else:
            a, b, operands, sig, out_shape, provider = node.args
            params, inputs = (out_shape,), (a, b)
        return cls(anchor, inputs, params, epi.parse(sig), list(operands), list(node.meta["resfuse"]["sources"]),
                   node, [], provider)

    def ops(self) -> list[str]:
        return epi.pattern_ops(self.tree)

    def emit(self) -> fx.Node | str:
        """Put the fused op in the graph in place of the group; returns the new node, or why it can't."""
        graph, last = self.out.graph, self.out
        args = (*self.inputs, list(self.operands), str(self.tree))
        args += (*self.params, self.provider)
        target = {"conv2d": torch.ops.resfuse.conv2d.default, "gemm": torch.ops.resfuse.gemm.default}[self.anchor]
        fake = _fake_call(target, args)
        want = self.out_val
        if tuple(fake.stride()) != tuple(want.stride()) and want.numel() > 1:
            return f"fused output strides {fake.stride()} differ from the graph's {want.stride()}"
        with graph.inserting_before(last):
            new = graph.call_function(target, args)
        new.meta["val"] = fake
        new.meta["resfuse"] = {"anchor": self.anchor, "sources": list(self.sources)}
        last.replace_all_uses_with(new)
        for n in reversed(list(dict.fromkeys([*self.replaced, last]))):
            if n is not new and not n.users:
                graph.erase_node(n)
        return new


def _fake_call(target, args):
    """Run the op's fake implementation on the nodes' fake values (metadata only)."""
    from torch._guards import detect_fake_mode
    from torch.utils._pytree import tree_leaves

    mode = detect_fake_mode([legality.val(a) for a in tree_leaves(args) if legality.val(a) is not None])
    real = fx.node.map_arg(args, lambda n: n.meta["val"])
    with mode:
        return target(*real)
