"""Activations written out in elementwise ops, replaced by the one ATen op they compute: a pass before the fusions.

Entry point: `named_activations(gm, ctx)`. HF transformers writes some activations as formulas: GPT-2's and
CodeGen's gelu_new, FastGELU, the erf GELU in Python, x * sigmoid(x), CLIP's QuickGELU. In the ATen graph their
input has several consumers, which no epilogue absorbs, so the GEMM before them ran without them. Each formula
(FORMULAS, traced by make_fx once) is matched where none of its inner values is read outside it (a training
forward that saves them for its backward keeps them), and replaced by aten.gelu or aten.silu (QuickGELU by a
scaled silu): the same function, rounded once instead of after each op, which match_epilogue then fuses.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

aten = torch.ops.aten


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# (HF transformers' name for it, the formula as written there, what replaces it: one op, or for QuickGELU the
# chain an epilogue takes, silu(1.702 x) / 1.702). A formula that traces to another's graph is matched by that one
# and named so (gelu_python_tanh's x * 0.5 is gelu_new's 0.5 * x).
FORMULAS = [
    ("gelu_new", lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
     _gelu_tanh),
    ("gelu_accurate", lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3)))),
     _gelu_tanh),
    ("gelu_fast", lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))), _gelu_tanh),
    ("gelu_python", lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))), lambda x: F.gelu(x)),
    ("silu", lambda x: x * torch.sigmoid(x), lambda x: F.silu(x)),
    ("silu", lambda x: torch.sigmoid(x) * x, lambda x: F.silu(x)),
    ("quick_gelu", lambda x: x * torch.sigmoid(1.702 * x), lambda x: F.silu(1.702 * x) / 1.702),
]


@functools.cache
def _patterns() -> list[tuple[str, fx.Graph, fx.Graph]]:
    def trace(f):  # f of one argument: make_fx traces every parameter of its signature
        with unset_fake_temporarily():  # real tracing, even where a caller's fake mode is on
            return make_fx(f)(torch.randn(4)).graph

    return [(name, trace(formula), trace(one)) for name, formula, one in FORMULAS]


def _inline(graph: fx.Graph, one: fx.Graph, x: fx.Node) -> fx.Node:
    """`one`'s ops applied to x, inserted at the graph's insertion point, each with its fake value; its output."""
    env = {}
    for node in one.nodes:
        if node.op == "placeholder":
            env[node] = x
        elif node.op == "call_function":
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = graph.call_function(node.target, args, kwargs)
            fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
            with detect_fake_mode([x.meta["val"]]) or contextlib.nullcontext():
                env[node].meta["val"] = node.target(*fake_args, **fake_kwargs)
        elif node.op == "output":
            return env[node.args[0]]
    raise AssertionError("a traced graph ends in its output")


def named_activations(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    found: dict[str, int] = {}
    for name, pattern, one in _patterns():
        matcher = SubgraphMatcher(pattern, match_output=False, match_placeholder=False,
                                  remove_overlapping_matches=True, ignore_literals=False)
        for match in matcher.match(gm.graph):
            (x,), (out,) = match.placeholder_nodes, match.returning_nodes
            xv, outv = x.meta.get("val"), out.meta.get("val")
            if xv is None or outv is None or xv.shape != outv.shape or xv.dtype != outv.dtype:
                continue  # a formula over a broadcast or promoted input is not the activation of x alone
            with gm.graph.inserting_before(out):
                out.replace_all_uses_with(_inline(gm.graph, one, x))
            for p in reversed(pattern.nodes):  # the pattern's own order, reversed: consumers first
                if p.op == "call_function":
                    gm.graph.erase_node(match.nodes_map[p])
            found[name] = found.get(name, 0) + 1
    if found:
        gm.recompile()
        ctx.report.rewrites.append(f"{ctx.graph} graph: " + ", ".join(
            f"{n} {name}" for name, n in found.items()) + " written out in elementwise ops, replaced by one op each")
    return gm
