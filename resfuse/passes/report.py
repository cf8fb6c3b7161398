"""The fusion report: what was fused (one entry per fused op), what was not and why, and which path ran.

Entry point: `Report.collect(gm, graph)`, the last pass; `PassContext.reject` records refusals as the passes
run. The report prints as a rich table (`print(report)` or `rich.print(report)`).
"""
from __future__ import annotations

import dataclasses
import io

import torch
import torch.fx as fx

from .. import epilogue as epi
from ..ops import PATHS
from . import legality
from .group import signature


@dataclasses.dataclass
class Fusion:
    graph: str  # "inference", "forward" or "backward"
    anchor: str  # "conv2d" | "gemm" | "batch_norm" | "conv2d_dgrad"
    ops: list[str]
    pattern: str
    sources: list[str]
    shapes: dict
    bytes_saved: int
    signature: str
    provider: str
    calls_before: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def ran(self) -> str:
        """The paths that ops of this signature took since the report was made ("triton", "reference")."""
        paths = sorted(p for (op, sig, p), n in PATHS.items()
                       if op == self.anchor and sig == self.signature and n > self.calls_before.get(p, 0))
        return ",".join(paths) or "not run"


@dataclasses.dataclass
class Rejection:
    graph: str
    node: str
    op: str
    reason: str


def bytes_saved(tree: epi.Node, out: torch.Tensor) -> int:
    """Memory traffic the fusion removes: each absorbed op would read its full-size inputs and write its
    output; fused, only the full-size operands are still read (an add: 3N unfused, N fused)."""
    def full(a):
        return epi.contains_acc(a) or (isinstance(a, epi.Operand) and a.kind == "full")

    def unfused(n):
        if not isinstance(n, epi.Op):
            return 0
        if n.name == "aux":  # no op of its own, and the fused kernel still writes that value
            return unfused(n.args[0]) - 1
        if n.name == "bn_stats":  # the sums pass would read g and x (and writes C values, not counted)
            return 2 + unfused(n.args[0])
        return 1 + sum(full(a) for a in n.args) + sum(unfused(a) for a in n.args)

    n_full = sum(o.kind == "full" for o in epi.operands(tree))
    return (unfused(tree) - n_full) * _numel(out) * out.element_size()


def _numel(t: torch.Tensor) -> int:
    """t's element count; under a dynamic batch, at the size seen at capture (no guard, and printable)."""
    return legality.hint(t.numel())


def _chain_fusion(node: fx.Node, sig: str) -> tuple[list, str, dict, int]:
    """(ops, pattern, shapes, bytes saved) of a conv2d_chain (passes/chain.py): both convs' epilogues, and the
    second conv no longer reading the first's output y."""
    trees = [epi.parse(s) for s in sig.split(";")]
    y, z = node.meta["val"]
    ops = [*epi.pattern_ops(trees[0]), "conv2d", *epi.pattern_ops(trees[1])]
    shapes = {"inputs": [_shape(node.args[0]), _shape(node.args[1]), _shape(node.args[4])], "out": tuple(z.shape)}
    saved = bytes_saved(trees[0], y) + bytes_saved(trees[1], z) + _numel(y) * y.element_size()
    return ops, "_".join(["conv2d", *ops]), shapes, saved


def _shortcut_fusion(node: fx.Node, sig: str) -> tuple[list, str, dict, int]:
    """(ops, pattern, shapes, bytes saved) of a conv2d_shortcut (passes/shortcut_conv.py): the shortcut conv's
    epilogue, then the main conv's, and the residual r neither written nor read back."""
    main, short = (epi.parse(s) for s in sig.split(";"))
    z = node.meta["val"]
    ops = [*epi.pattern_ops(short), "conv2d", *epi.pattern_ops(main)]
    shapes = {"inputs": [_shape(node.args[i]) for i in (0, 1, 5, 6)], "out": tuple(z.shape)}
    saved = bytes_saved(main, z) + bytes_saved(short, z) + 2 * _numel(z) * z.element_size()
    return ops, "_".join(["conv2d", *ops]), shapes, saved


def _shape(node) -> tuple | None:
    v = legality.val(node)
    return None if v is None else tuple(v.shape)  # None: an absent argument (batch norm without affine)


@dataclasses.dataclass
class Report:
    fusions: list[Fusion] = dataclasses.field(default_factory=list)
    rejected_by_node: dict = dataclasses.field(default_factory=dict)
    graphs: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    rewrites: list[str] = dataclasses.field(default_factory=list)  # graph changes that are not fusions
    notes: list[str] = dataclasses.field(default_factory=list)  # what ran differently than asked, and why
    peak_bytes: dict = dataclasses.field(default_factory=dict)  # graph -> (static peak before, after the passes)

    @property
    def rejected(self) -> list[Rejection]:
        return list(self.rejected_by_node.values())

    def reject(self, graph: str, node: fx.Node, reason: str) -> None:
        self.rejected_by_node[(graph, node.name)] = Rejection(graph, node.name, str(node.target), reason)

    def collect(self, gm: fx.GraphModule, graph: str) -> fx.GraphModule:
        self.graphs.append(graph)
        for node in gm.graph.nodes:
            info = node.meta.get("resfuse")
            if node.op != "call_function" or info is None:
                continue
            sig = info.get("signature") or signature(node)
            before = {p: n for (op, s, p), n in PATHS.items() if op == info["anchor"] and s == sig}
            if info["anchor"] in ("conv2d_chain", "conv2d_shortcut"):
                pair = _chain_fusion if info["anchor"] == "conv2d_chain" else _shortcut_fusion
                ops, pattern, shapes, saved = pair(node, sig)
            else:
                val = node.meta["val"]
                tree, out = epi.parse(sig), val[0] if isinstance(val, tuple) else val
                ops = epi.pattern_ops(tree)
                pattern = "_".join([info["anchor"], *ops])
                shapes = {"inputs": [_shape(a) for a in node.args[:2] if isinstance(a, fx.Node)],
                          "out": tuple(out.shape)}
                over = legality.val(node.args[0]) if info.get("prologue") else out  # where the epilogue's values lie
                saved = bytes_saved(tree, over)
            self.fusions.append(Fusion(graph, info["anchor"], ops, pattern, info["sources"], shapes, saved, sig,
                                       node.args[-1], before))
            fused_names = set(info["sources"])
            for key in [k for k in self.rejected_by_node if k[0] == graph and k[1] in fused_names]:
                del self.rejected_by_node[key]  # a later pass fused what an earlier one refused
        return gm

    def count(self, pattern_op: str, graph: str | None = None) -> int:
        return sum(pattern_op in f.ops for f in self.fusions if graph in (None, f.graph))

    def __rich__(self):
        from rich.console import Group as RGroup
        from rich.table import Table

        fused = Table(title=f"resfuse: {len(self.fusions)} fused ops", show_lines=False)
        for col in ("graph", "pattern", "out shape", "saved MB", "provider", "ran", "sources"):
            fused.add_column(col, no_wrap=col in ("pattern", "out shape"))
        for f in self.fusions:
            fused.add_row(f.graph, f.pattern, "x".join(map(str, f.shapes["out"])), f"{f.bytes_saved / 1e6:.2f}",
                          f.provider, f.ran, ", ".join(f.sources))
        rej = Table(title=f"not fused: {len(self.rejected)}")
        for col in ("graph", "node", "op", "reason"):
            rej.add_column(col)
        for r in self.rejected:
            rej.add_row(r.graph, r.node, r.op, r.reason)
        parts = [fused, rej] + [f"[red]error:[/red] {e}" for e in self.errors]
        parts += [f"rewrite: {r}" for r in self.rewrites] + [f"note: {n}" for n in self.notes]
        parts += [f"{g} graph: static peak {a / 1e6:.1f} MB -> {b / 1e6:.1f} MB after the passes"
                  for g, (a, b) in self.peak_bytes.items()]
        total = sum(f.bytes_saved for f in self.fusions)
        parts.append(f"estimated memory traffic saved: {total / 1e6:.1f} MB per call")
        return RGroup(*parts)

    def __str__(self):
        from rich.console import Console

        buf = io.StringIO()
        Console(file=buf, width=160, force_terminal=False).print(self)
        return buf.getvalue()

    def to_dict(self) -> dict:
        fusions = [{k: v for k, v in dataclasses.asdict(f).items() if k != "calls_before"} for f in self.fusions]
        return {"fusions": [{**d, "ran": f.ran} for d, f in zip(fusions, self.fusions)],
                "rejected": [dataclasses.asdict(r) for r in self.rejected], "graphs": self.graphs,
                "errors": self.errors, "rewrites": self.rewrites, "notes": self.notes,
                "peak_bytes": self.peak_bytes}
