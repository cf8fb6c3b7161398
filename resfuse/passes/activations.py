"""Activations written out in elementwise ops, replaced by the one ATen op they compute: a pass before the fusions.

Entry point: `named_activations(gm, ctx)`. HF transformers writes some activations as formulas: GPT-2's and
CodeGen's gelu_new, FastGELU, the erf GELU in Python, x * sigmoid(x). In the ATen graph their input has several
consumers, which no epilogue absorbs, so the GEMM before them ran without them. Each formula (FORMULAS, traced by
make_fx once) is matched where none of its inner values is read outside it (a training forward that saves them
for its backward keeps them), and replaced by aten.gelu or aten.silu: the same function, rounded once instead of
after each op, which match_epilogue then fuses.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

aten = torch.ops.aten
TANH = {"approximate": "tanh"}

# (HF transformers' name for it, the formula as written there, the one op's target and kwargs). A formula that
# traces to another's graph is matched by that one (gelu_python_tanh's x * 0.5 is gelu_new's 0.5 * x), and named so.
FORMULAS = [
    ("gelu_new", lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
     aten.gelu.default, TANH),
    ("gelu_accurate", lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3)))),
     aten.gelu.default, TANH),
    ("gelu_fast", lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
     aten.gelu.default, TANH),
    ("gelu_python", lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))), aten.gelu.default, {}),
    ("silu", lambda x: x * torch.sigmoid(x), aten.silu.default, {}),
    ("silu", lambda x: torch.sigmoid(x) * x, aten.silu.default, {}),
]


@functools.cache
def _patterns() -> list[tuple[str, fx.Graph, object, dict]]:
    return [(name, make_fx(formula)(torch.randn(4)).graph, target, kwargs)
            for name, formula, target, kwargs in FORMULAS]


def _order(graph: fx.Graph):
    position = {node: i for i, node in enumerate(graph.nodes)}
    return position.__getitem__


def named_activations(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    found: dict[str, int] = {}
    for name, pattern, target, kwargs in _patterns():
        matcher = SubgraphMatcher(pattern, match_output=False, match_placeholder=False,
                                  remove_overlapping_matches=True, ignore_literals=False)
        for match in matcher.match(gm.graph):
            (x,), (out,) = match.placeholder_nodes, match.returning_nodes
            xv, outv = x.meta.get("val"), out.meta.get("val")
            if xv is None or outv is None or xv.shape != outv.shape or xv.dtype != outv.dtype:
                continue  # a formula over a broadcast or promoted input is not the activation of x alone
            with gm.graph.inserting_before(out):
                one = gm.graph.call_function(target, (x,), dict(kwargs))
            one.meta["val"] = outv
            out.replace_all_uses_with(one)
            inner = [n for p, n in match.nodes_map.items() if p.op == "call_function"]
            for node in sorted(inner, key=_order(gm.graph), reverse=True):  # consumers first
                gm.graph.erase_node(node)
            found[name] = found.get(name, 0) + 1
    if found:
        gm.recompile()
        ctx.report.rewrites.append(f"{ctx.graph} graph: " + ", ".join(
            f"{n} {name} written out in elementwise ops" for name, n in found.items()) + " replaced by their one op")
    return gm
