"""A training batch norm's statistics, computed in the epilogue of the conv that produces its input.

Entry point: `conv_stats(gm, ctx)`, a forward-graph pass after the batch-norm fusions (switch `conv_stats`).
Training batch norm reads the conv output y twice: once for its statistics, once to normalize it. Where y comes
straight from aten.convolution, the conv becomes resfuse::conv2d_stats (ops/training.py), which returns y and the
fp32 per-channel sum(y) and sum(y * y) from cuDNN's conv + genstats graph, and each batch norm reading y
(resfuse::batch_norm, or batch_norm_stats for a folded shortcut) takes them as `sums`: its statistics pass over y
is gone. On an H100 a ResNet-50 bs256 training step took 1.8-2.5 ms less (BENCHMARKS.md, nineteenth session).

Legal where the batch norm runs on our kernel (only it takes sums) and reads y itself; the conv is a plain 2-D one
(groups 1, no bias, not transposed) and y is laid out channels_last or contiguous. On CUDA, cuDNN must be
installed and have an engine for the graph (checked here, on the fake tensors' shapes), the dtype fp16 or bf16,
and the input channels a multiple of 8 (ResNet's stem, 3 channels, stays on ATen: cuDNN has no engine for it).
genstats sums with atomics, so the statistics' last bits vary run to run (by about 1e-7; cuDNN's weight gradients
already do so in eager): under torch.use_deterministic_algorithms or cudnn.deterministic the pass stays off. The
sums are of the conv's fp32 values before y's rounding to fp16, so the mean and variance differ from those of y
by a part in 10^5 of the spread or less. On CPU under the interpreter (tests) the op's reference path computes the
sums in torch. y is the same tensor as before, kept for backward as before, so no tensor lives longer.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import legality
from .group import fake_call

aten = torch.ops.aten
CONV = aten.convolution.default
CONV_STATS = torch.ops.resfuse.conv2d_stats.default
BN_OPS = (torch.ops.resfuse.batch_norm.default, torch.ops.resfuse.batch_norm_stats.default)


def conv_stats(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if not ctx.config.conv_stats or ctx.graph != "forward":
        return gm
    done = []
    for conv in list(gm.graph.nodes):
        if conv.op != "call_function" or conv.target != CONV:
            continue
        norms = [u for u in conv.users if u.target in BN_OPS and u.args[0] is conv and u.args[-1] == "triton"
                 and "sums" not in u.kwargs]
        if not norms:
            continue
        provider = "cudnn" if conv.meta["val"].device.type == "cuda" else "reference"
        why = _refusal(conv, provider)
        if why:
            ctx.reject(conv, f"batch norm statistics not computed in this conv: {why}")
            continue
        _rewrite(conv, norms, provider)
        done.append(conv.name)
    if done:
        gm.graph.lint()
        gm.recompile()
        ctx.report.rewrites.append(f"{ctx.graph} graph: {len(done)} conv(s) compute their batch norm's statistics "
                                   f"in their epilogue ({', '.join(done)})")
    return gm


def _refusal(conv: fx.Node, provider: str) -> str | None:
    x, w, bias, stride, padding, dilation, transposed, _output_padding, groups = conv.args
    xv, wv, yv = legality.val(x), legality.val(w), legality.val(conv)
    if xv is None or wv is None or yv is None or yv.dim() != 4:
        return "not a 2-D conv with known shapes"
    if bias is not None or transposed or groups != 1:
        return "a bias, a transposed or a grouped conv (conv + genstats is built for none of them)"
    if legality.memory_format(yv) is None:
        return f"output strides {yv.stride()} are neither channels_last nor contiguous"
    if provider == "cudnn":
        if torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic:
            return ("deterministic algorithms are asked for, and genstats sums with atomics (its last bits vary "
                    "run to run)")
        if xv.shape[1] % 8:
            return (f"{xv.shape[1]} input channels, not a multiple of 8 (cuDNN had no conv + genstats engine for "
                    f"ResNet's 3-channel stem)")
        from ..providers import cudnn_stats

        return cudnn_stats.conv_stats_refusal(xv, wv, yv.shape, yv.stride(), stride, padding, dilation)
    return None


def _rewrite(conv: fx.Node, norms: list, provider: str) -> None:
    graph = conv.graph
    x, w, _bias, stride, padding, dilation = conv.args[:6]
    channels_last = legality.memory_format(legality.val(conv)) == torch.channels_last
    args = (x, w, list(stride), list(padding), list(dilation), channels_last, provider)
    with graph.inserting_before(conv):
        new = graph.call_function(CONV_STATS, args)
        y = graph.call_function(operator.getitem, (new, 0))
        sums = graph.call_function(operator.getitem, (new, 1))
    new.meta["val"] = fake_call(CONV_STATS, args)
    y.meta["val"], sums.meta["val"] = new.meta["val"]
    conv.replace_all_uses_with(y)
    graph.erase_node(conv)
    for bn in norms:
        bn.update_kwarg("sums", sums)
