"""A 3-channel image's conv: in inference, our own (resfuse::image_conv); else it reads the image padded to 4
channels, so that cuDNN does not pad it in a pass of its own.

Entry points: `pad_channels(gm, ctx)`, the last rewrite (switches `image_convs` and `pad_channels`), on every
graph kind: it changes only the convs left to ATen (cuDNN), never a fused op's input; and
`pad_channels_joint(gm, ctx)`, on a training step's joint graph before it is partitioned (capture/backend.py),
which pads the image once for the forward conv and its weight gradient.
For an NHWC fp16 image of 3 channels (a CNN's stem), cuDNN's first-layer kernels take 4 channels: it pads the
image itself (nhwcAddPadding, a pass over it, after a memset) before the forward conv and again before the
weight gradient. Here aten.convolution and aten.convolution_backward read x and w through resfuse::pad_channels
(ops/padding.py) instead, which zero-pads them to 4 channels, channels_last, and where x is autocast's cast of
the fp32 image, casts in the same pass. The padded channel multiplies zeros, so y is unchanged (bit-identical on
an H100), and the weight gradient's padded slice is dropped. On an H100 the ResNet-50 stem at bs256 took 398
against 583 us forward and 417 against 578 us for the weight gradient (bench/stem_pad.py, BENCHMARKS.md).

In an inference graph, such a conv without bias becomes resfuse::image_conv (ops/image_conv.py) where
kernels/conv2d_image.py takes it, at any batch, on Hopper GPUs (where it was measured; it is not tuned per shape):
its own padding pass makes the image's rows 16-byte aligned for an implicit GEMM that beat cuDNN's first-layer
kernel (bench/stem_rows.py), and casts autocast's fp32 image and weight as it pads. Otherwise it is padded:
rewritten where the conv is 2-D, groups 1, not transposed, its input fp16 and channels_last with 3 channels and
at least MIN_PIXELS pixels (static shapes), on CUDA or under the interpreter (tests); a backward only where the
input's gradient is not asked for (an image's never is: its padded copy would cost a pass to slice).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import legality
from .group import fake_call

aten = torch.ops.aten
CONV, CONV_BACKWARD = aten.convolution.default, aten.convolution_backward.default
PAD = torch.ops.resfuse.pad_channels.default
IMAGE_CONV = torch.ops.resfuse.image_conv.default
MEASURED_ON = (9,)  # compute capability majors where image_conv beat cuDNN's first-layer kernel (H100)
CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
IMAGE_CHANNELS, PADDED_CHANNELS = 3, 4
# Below about a million pixels (a batch of 21 at 224x224) the padding's launches cost more than cuDNN's pass:
# at bs1 the stem's forward took 9.9 against 12.7 us, and each launch about 2-3 us (two: x and w).
MIN_PIXELS = 1 << 20


def pad_channels(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    done, convs = [], []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (CONV, CONV_BACKWARD):
            continue
        xv = _image(node.args[0] if node.target is CONV else node.args[1], ctx)
        if xv is None:
            continue
        not_ours = _image_conv(node, xv, ctx)
        if not_ours is None:
            convs.append(node.name)
            continue
        if not ctx.config.pad_channels:
            continue
        why = _refusal(node, xv) or _rewrite(node, "triton")
        if why is None:
            done.append(node.name)
        elif (ctx.graph, node.name) not in ctx.report.rejected_by_node:  # a fusion's reason says more
            ctx.reject(node, f"3-channel input not padded to 4 for cuDNN: {why} (nor an image conv: {not_ours})")
    if convs:
        ctx.report.rewrites.append(f"{ctx.graph} graph: {len(convs)} conv(s) over a 3-channel image run as "
                                   f"resfuse::image_conv ({', '.join(convs)})")
    if done:
        ctx.report.rewrites.append(f"{ctx.graph} graph: {len(done)} conv(s) read their 3-channel input padded to "
                                   f"4 channels ({', '.join(done)})")
    if done or convs:
        gm.graph.lint()
        gm.recompile()
    return gm


def _image_conv(node: fx.Node, xv: torch.Tensor, ctx) -> str | None:
    """Replace an inference conv by resfuse::image_conv; None, or why not (then the graph is as it was)."""
    if node.target is not CONV or ctx.graph != "inference" or not ctx.config.image_convs:
        return "not an inference conv" if ctx.config.image_convs else "image_convs is off"
    from ..kernels import conv2d_image as kernel  # here: importing the kernels builds Triton helpers, which must wait

    x, w, bias, stride, padding, dilation, transposed, _, groups = node.args
    if bias is not None or transposed or legality.val(w) is None:
        return "a bias or a transposed conv"
    dtype = xv.dtype
    # the kernel casts as it pads: it reads the fp32 tensor that a cast only this conv reads casts
    src = [u if legality.val(u).dtype in (dtype, torch.float32) else t
           for t, u in ((t, _uncast(t, {node})) for t in (x, w))]
    why = (kernel.refusal(*(legality.val(t) for t in src), stride, padding, dilation, groups, dtype)
           or _unmeasured(xv.device))
    if why is None:
        args = (*src, list(stride), list(padding), dtype, "triton")
        val = fake_call(IMAGE_CONV, args)
        if not legality.same_strides(node.meta["val"], val):
            why = "the conv's output is not channels_last"
    if why is not None:
        return why
    graph = node.graph
    with graph.inserting_before(node):
        new = graph.call_function(IMAGE_CONV, args)
    new.meta["val"] = val
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    for t in (x, w):  # a cast that only the conv read: the kernel casts now
        if t not in src and not t.users:
            graph.erase_node(t)
    return None


def _unmeasured(device: torch.device) -> str | None:
    """image_conv is not tuned against cuDNN per shape: it runs only on the GPUs it was measured faster on."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability[0] not in MEASURED_ON:
        return f"compute capability {capability}: image_conv was measured against cuDNN on Hopper (9.x) only"
    return None


def pad_channels_joint(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """On a training step's joint graph, before aot_autograd partitions it: a stem conv and the weight-gradient
    convolution_backward that reads the same image and weight read one padded copy of each, made from the fp32
    image in the forward and saved for the backward, a third larger than the fp16 image it replaces. The graphs
    pad_channels then sees hold 4-channel convs, which it leaves alone. Without this the forward casts the image
    (saved for the backward) and pads the cast, and the backward pads it again: on the ResNet-50 bs256 stem, an
    H100, 77 + 100 + 102 us against one pass of about 105."""
    if not ctx.config.pad_channels:
        return gm
    done = []
    for conv in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is CONV]:
        x, w = conv.args[:2]
        xv = _image(x, ctx)
        if xv is None:
            continue
        grads = [u for u in x.users if u.target is CONV_BACKWARD and u.args[1] is x and u.args[2] is w
                 and list(u.args[4:10]) == list(conv.args[3:9])]  # stride ... groups: this conv's own backward
        if not grads or _refusal(conv, xv) or any(_refusal(b, xv) for b in grads):
            continue  # pad_channels decides (and reports) on the partitioned graphs
        if _rewrite(conv, "triton", readers=tuple(grads)) is not None:
            continue
        padded = conv.args[:2]
        for b in grads:
            _rewrite(b, "triton", padded)
        done.append(conv.name)
    if done:
        gm.graph.lint()
        gm.recompile()
        ctx.report.rewrites.append(f"joint graph: {len(done)} conv(s) and their weight gradients read one copy of "
                                   f"their 3-channel input padded to 4 channels, saved padded ({', '.join(done)})")
    return gm


def _image(x, ctx) -> torch.Tensor | None:
    """x's value where x is a 4-D 3-channel tensor on our kernels' provider, else None: on CPU (no cuDNN, and no
    kernel of ours unless interpreted) there is nothing to gain."""
    xv = legality.val(x)
    if xv is None or xv.dim() != 4 or xv.shape[1] != IMAGE_CHANNELS or ctx.provider_for(x) != "triton":
        return None
    return xv


def _refusal(node: fx.Node, xv: torch.Tensor) -> str | None:
    transposed, groups = node.args[6:9:2] if node.target is CONV else node.args[7:10:2]
    if transposed or groups != 1:
        return "a transposed or grouped conv"
    n, _, h, w = xv.shape
    if not all(isinstance(d, int) for d in (n, h, w)):
        return "a dynamic shape (the gain depends on the image's size)"
    if n * h * w < MIN_PIXELS:
        return f"{n * h * w} pixels, under {MIN_PIXELS} (the padding's launches would cost more than they save)"
    if xv.dtype != torch.float16:
        return f"{xv.dtype} input (measured for fp16 only)"
    if legality.memory_format(xv) != torch.channels_last:
        return "the input is not channels_last (cuDNN's padding pass is NHWC's)"
    if node.target is CONV_BACKWARD:
        if node.args[-1][0] or not node.args[-1][1]:
            return ("the input's gradient is asked for (slicing its padded copy would cost a pass), or the "
                    "weight's is not")
        if legality.memory_format(node.meta["val"][1]) is None:
            return "the weight gradient's layout is neither channels_last nor contiguous"
    return None


def _rewrite(node: fx.Node, provider: str, padded: list[fx.Node] | None = None,
             readers: tuple = ()) -> str | None:
    """Point the conv's x and w at padded copies (`padded`, else new ones, which read through a cast that only
    the conv and `readers` read); None, or why not (then the graph is as it was)."""
    graph = node.graph
    at = 0 if node.target is CONV else 1
    before = node.meta["val"]
    old = node.args[at:at + 2]
    made = padded is None
    if made:
        with graph.inserting_before(node):
            padded = [_padded(graph, t, provider, {node, *readers}) for t in old]
    node.update_arg(at, padded[0])
    node.update_arg(at + 1, padded[1])
    node.meta["val"] = fake_call(node.target, node.args)
    if node.target is CONV and not legality.same_strides(before, node.meta["val"]):
        node.update_arg(at, old[0])
        node.update_arg(at + 1, old[1])
        node.meta["val"] = before
        for p in padded if made else []:
            graph.erase_node(p)
        return "the conv's output would change layout"
    if node.target is CONV_BACKWARD:
        _slice_weight_grad(node, before[1])
    for t in old:  # a cast that only the conv read: the pad casts now
        if not t.users:
            graph.erase_node(t)
    return None


def _uncast(t: fx.Node, readers: set) -> fx.Node:
    """The tensor t casts, where t is a cast on one device that only `readers` read; else t."""
    if t.target in CASTS and set(t.users) <= readers and legality.val(t.args[0]) is not None \
            and legality.val(t.args[0]).device == legality.val(t).device:
        return t.args[0]
    return t


def _padded(graph: fx.Graph, t: fx.Node, provider: str, readers: set) -> fx.Node:
    """resfuse::pad_channels of t, in t's dtype; reading the fp32 tensor where t is a cast only `readers` read."""
    src = _uncast(t, readers)
    new = graph.call_function(PAD, (src, PADDED_CHANNELS, legality.val(t).dtype, provider))
    new.meta["val"] = fake_call(PAD, new.args)
    return new


def _slice_weight_grad(node: fx.Node, before: torch.Tensor) -> None:
    """The weight gradient of 4 channels, back to the 3 and the layout the graph had."""
    graph = node.graph
    for get in [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]:
        with graph.inserting_after(get):
            sliced = graph.call_function(aten.slice.Tensor, (get, 1, 0, IMAGE_CHANNELS))
        with graph.inserting_after(sliced):
            dense = graph.call_function(aten.clone.default, (sliced,),
                                        {"memory_format": legality.memory_format(before)})
        get.replace_all_uses_with(dense, delete_user_cb=lambda user: user is not sliced)
        get.meta["val"] = node.meta["val"][1]
        sliced.meta["val"] = fake_call(aten.slice.Tensor, sliced.args)
        dense.meta["val"] = fake_call(lambda t: aten.clone.default(t, memory_format=dense.kwargs["memory_format"]),
                                      dense.args)
