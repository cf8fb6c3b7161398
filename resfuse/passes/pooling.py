"""Max pooling onto resfuse's kernels: aten.max_pool2d_with_indices becomes resfuse::max_pool2d and its backward
resfuse::max_pool2d_backward (ops/pooling.py), where the fused ops run on Triton.

Entry point: `max_pool(gm, ctx)`, a pass after the fusions. ATen's channels_last kernels ran at a fraction of the
memory bandwidth (the stem pool of a ResNet-50 bs256 step: 2.6 ms in ATen). Two things ride along:
  - an inference graph never reads the indices: the forward then does not write them (an int64 tensor as large
    as the pooled output's four times over, in fp16); a training forward whose indices only its backward reads
    writes them as int8 window codes (kernels/max_pool.py), whose flag also stands in for the stem's relu mask;
  - a backward's relu gradient right after the pool's (the stem's relu -> max-pool) is applied as the kernel
    writes grad_input, saving a pass over the largest activation of the net.
  - an inference pool whose input is a fused conv's output, read by nothing else, computes that conv's epilogue
    itself when the epilogue is monotone within each channel (the stem's batch norm and relu): the conv runs
    bare on cuDNN, and its output is written once and read once (kernels/max_pool.py: a window's largest value
    of the epilogue is its value at the window's largest or smallest input).
The report lists the rewrites (and the last as a fusion, anchor max_pool2d); refusals say why.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import epilogue as epi
from ..ops.fused import groups_of
from . import legality
from ..kernels import WINDOW_NOT_POSITIVE
from .group import TARGET, fake_call, signature

aten = torch.ops.aten
FORWARD = aten.max_pool2d_with_indices.default
BACKWARD = aten.max_pool2d_with_indices_backward.default


def max_pool(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    if not ctx.config.max_pool:
        return gm
    done, masked, took = 0, 0, 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (FORWARD, BACKWARD):
            continue
        x = node.args[0] if node.target == FORWARD else node.args[1]
        if ctx.provider_for(x) != "triton":
            continue  # ATen's path anyway (CPU without the interpreter, or providers=("aten",))
        why = _refusal(x)
        if why:
            ctx.reject(node, why)
            continue
        if node.target == FORWARD:
            conv = _conv_epilogue_to_take(node, ctx)
            why, taken = _forward_with_epilogue(node, conv) if conv is not None else (_forward(node, ctx), False)
            took += taken
        else:
            why, fused_mask = _backward(node)
            masked += fused_mask
        if why:
            ctx.reject(node, why)
        else:
            done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
        extra = f" ({masked} with relu's gradient)" if masked else ""
        extra += f" ({took} computing the epilogue of the conv before it)" if took else ""
        ctx.report.rewrites.append(f"{ctx.graph} graph: {done} max-pool op(s) on resfuse's kernels{extra}")
    return gm


def _pair(v, default) -> list[int]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    if not v:
        v = list(default)
    return v * 2 if len(v) == 1 else v


def _params(args) -> list:
    """kernel, stride, padding, dilation, ceil_mode with ATen's defaults filled in."""
    kernel = _pair(args[0], None)
    stride = _pair(args[1] if len(args) > 1 else [], kernel)
    return [kernel, stride, _pair(args[2] if len(args) > 2 else 0, [0]),
            _pair(args[3] if len(args) > 3 else 1, [1]), bool(args[4]) if len(args) > 4 else False]


def _refusal(x: fx.Node) -> str | None:
    v = legality.val(x)
    if v is None or v.dim() != 4:
        return "max-pool of an unbatched (3-D) input, or without metadata"
    why = legality.first(legality.static_tensor(x), legality.supported_dtype(x))
    return f"max-pool: {why}" if why else None


def _same_layout(fake: torch.Tensor, want: torch.Tensor | None) -> bool:
    return want is not None and legality.same_strides(fake, want) and fake.dtype == want.dtype


def _forward(node: fx.Node, ctx) -> str | None:
    x, *rest = node.args
    params = _params(rest)
    index_users = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
    index_dtype = None
    if any(u.users for u in index_users):
        codes = params[0][0] * params[0][1] <= WINDOW_NOT_POSITIVE and _saved_for_backward_only(index_users, ctx)
        index_dtype = torch.int8 if codes else torch.int64
    args = (x, *params, index_dtype, "triton")
    fake = fake_call(torch.ops.resfuse.max_pool2d.default, args)
    want = node.meta.get("val")
    if not (_same_layout(fake[0], want[0]) and (index_dtype is None or legality.same_strides(fake[1], want[1]))):
        return "max-pool output layout differs from ATen's"
    for u in index_users:
        if u.users:
            u.meta["val"] = fake[1]
        else:
            node.graph.erase_node(u)
    node.target, node.args, node.kwargs = torch.ops.resfuse.max_pool2d.default, args, {}
    node.meta["val"] = fake
    return None


def _saved_for_backward_only(index_users: list[fx.Node], ctx) -> bool:
    """Are the indices read by nothing but the backward (a training forward's outputs past the user's, which
    aot_autograd saves for the backward: TracingContext's fw_metadata says where the user's end)?"""
    from torch._guards import TracingContext

    tracing = TracingContext.try_get()
    meta = tracing.fw_metadata if tracing is not None else None
    if ctx.graph != "forward" or meta is None:
        return False
    output = index_users[0].graph.output_node()
    outs = list(output.args[0])
    users_end = meta.num_forward + len(getattr(meta, "tokens", None) or {})
    return all(set(u.users) == {output} and outs.index(u) >= users_end for u in index_users)


def _conv_epilogue_to_take(node: fx.Node, ctx) -> fx.Node | None:
    """The fused conv whose epilogue this inference pool can compute instead (the stem's batch norm and relu):
    the pool is its only reader, and the epilogue is monotone within each channel (epilogue.monotone_refusal)."""
    x = node.args[0]
    reads_indices = any(u.users for u in node.users if u.target is operator.getitem and u.args[1] == 1)
    if ctx.graph != "inference" or reads_indices or not isinstance(x, fx.Node) or len(x.users) != 1:
        return None
    if x.target != TARGET["conv2d"] or epi.monotone_refusal(epi.parse(signature(x))) is not None:
        return None
    return x


def _forward_with_epilogue(node: fx.Node, fused: fx.Node) -> tuple[str | None, bool]:
    """conv(epilogue) -> pool  =>  bare conv (cuDNN) -> pool(epilogue): the conv's output is written once, raw,
    and read once, instead of written raw, read, written through the epilogue and read again (cuDNN wins the
    stem conv), or written through the epilogue and read (our kernel wins it). Returns (why not rewritten at
    all, whether the pool took the epilogue): a layout the pooled epilogue cannot give keeps the fused conv."""
    graph = node.graph
    inp, weight, operands, sig, stride, padding, dilation, provider = fused.args
    with graph.inserting_before(fused):
        conv = graph.call_function(aten.convolution.default, (inp, weight, None, stride, padding, dilation, False,
                                                              [0, 0], groups_of(legality.val(inp), legality.val(weight))))
        conv.meta["val"] = fake_call(aten.convolution.default, conv.args)
        pooled = graph.call_function(torch.ops.resfuse.max_pool2d_epilogue.default,
                                     (conv, operands, sig, *_params(node.args[1:]), provider))
        pooled.meta["val"] = fake_call(pooled.target, pooled.args)
    want = node.meta["val"][0]
    if not _same_layout(pooled.meta["val"], want):
        graph.erase_node(pooled)
        graph.erase_node(conv)
        return _forward(node), False  # without the epilogue
    pooled.meta["resfuse"] = {"anchor": "max_pool2d", "sources": [*fused.meta["resfuse"]["sources"], node.name],
                              "signature": sig, "prologue": True}
    for item in list(node.users):
        if item.args[1] == 0:
            item.replace_all_uses_with(pooled)
        graph.erase_node(item)
    graph.erase_node(node)
    graph.erase_node(fused)
    return None, True


def _backward(node: fx.Node) -> tuple[str | None, bool]:
    grad_out, x, *rest = node.args
    indices = rest[-1]
    params = _params(rest[:-1])
    mask, threshold, relu = None, 0.0, _relu_gradient(node)
    if relu is not None:
        mask, threshold = relu.args[1], float(relu.args[2])
    args = (grad_out, x, indices, *params, mask, threshold, "triton")
    fake = fake_call(torch.ops.resfuse.max_pool2d_backward.default, args)
    last = relu if relu is not None else node
    if not _same_layout(fake, legality.val(last)):
        # ATen computes it, through our op all the same: its forward may have written window codes
        node.target, node.kwargs = torch.ops.resfuse.max_pool2d_backward.default, {}
        node.args = (grad_out, x, indices, *params, None, 0.0, "reference")
        return "max-pool backward layout differs from ATen's", False
    node.target, node.args, node.kwargs = torch.ops.resfuse.max_pool2d_backward.default, args, {}
    node.meta["val"] = fake
    if relu is not None:
        relu.prepend(node)  # its only consumer was the relu gradient, whose mask may come after it (a detach)
        relu.replace_all_uses_with(node)
        node.graph.erase_node(relu)
    return None, relu is not None


def _relu_gradient(node: fx.Node) -> fx.Node | None:
    """The threshold_backward that is the pool gradient's only consumer, with a mask shaped like it."""
    users = list(node.users)
    if len(users) != 1 or users[0].target != aten.threshold_backward.default or users[0].args[0] is not node:
        return None
    mask = users[0].args[1]
    v, g = legality.val(mask), legality.val(node)
    if (not isinstance(mask, fx.Node) or v is None or g is None or tuple(v.shape) != tuple(g.shape)
            or legality.supported_dtype(mask)):
        return None
    return users[0]
