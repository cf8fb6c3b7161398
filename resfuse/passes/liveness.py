"""Static peak memory of an FX graph: the most bytes of tensors alive at once when its nodes run in order.

Entry point: `peak_bytes(gm) -> int`. A node's value is alive from the node that makes it to its last user;
graph inputs from the start (they are the caller's) and graph outputs to the end; views and getitems share
their source's storage and count once. The backend measures every graph before and after the passes, so
that the report shows whether a fusion lengthened a lifetime enough to raise the peak (issue 6's rule).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .legality import hint


def _nbytes(node: fx.Node) -> int:
    """Bytes of the node's value; a symbolic size (a dynamic batch) counts at its hint, the size seen at capture,
    without a guard (a comparison of symbolic sizes would add one, and the report could not print them)."""
    v = node.meta.get("val")
    vals = v if isinstance(v, (tuple, list)) else [v]
    return sum(hint(t.untyped_storage().nbytes()) for t in vals if isinstance(t, torch.Tensor))


def _owner(node: fx.Node) -> fx.Node:
    """The node whose allocation `node` lives in (views and getitems share their source's)."""
    while node.op == "call_function" and node.all_input_nodes and (
            getattr(node.target, "is_view", False) or node.target.__name__ == "getitem"):
        node = node.all_input_nodes[0]
    return node


def peak_bytes(gm: fx.GraphModule) -> int:
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        owner = _owner(n)
        if n.op == "placeholder":
            last_use[owner] = end
        for u in n.users:
            last_use[owner] = max(last_use.get(owner, 0), end if u.op == "output" else order[u])
    live, peak, frees = 0, 0, {}
    for i, n in enumerate(nodes):
        if _owner(n) is n and n.op != "output":
            live += _nbytes(n)
            frees.setdefault(last_use.get(n, i), []).append(n)
        peak = max(peak, live)
        for dead in frees.pop(i, []):
            live -= _nbytes(dead)
    return peak
