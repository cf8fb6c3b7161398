"""cuDNN's conv + genstats graph, for training: `conv_stats(x, weight, stride, padding, dilation, y, sums)` and
`conv_stats_refusal(...)`. conv_fprop whose output also feeds a genstats node, so the conv's epilogue computes the
per-channel sum and sum of squares that the training batch norm after it needs (ops/training.py's conv2d_stats,
made by passes/conv_stats.py). Beside the cudnn provider (providers/cudnn.py), whose frontend loading it shares.
"""
from __future__ import annotations

import torch

from .cudnn import ONE_PIXEL, _build, _cudnn, follow_stream


class StatsPlan:
    """A built cuDNN graph: y = conv_fprop(x, w) (fp32 accumulation, y in x's dtype) and genstats(y) -> fp32
    sum(y) and sum(y * y) per channel. The graph is built from shapes, strides and dtypes alone."""

    def __init__(self, key):
        cudnn = _cudnn()
        (x_shape, x_stride, w_shape, w_stride, y_shape, y_stride, dtype, stride, padding, dilation) = key
        io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]
        f32 = cudnn.data_type.FLOAT
        self.handle = cudnn.create_handle()
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)
        self.x = g.tensor(dim=list(x_shape), stride=list(x_stride), data_type=io, name="x")
        self.w = g.tensor(dim=list(w_shape), stride=list(w_stride), data_type=io, name="w")
        self.y = g.conv_fprop(image=self.x, weight=self.w, padding=list(padding), stride=list(stride),
                              dilation=list(dilation), compute_data_type=f32, name="conv")
        self.y.set_output(True).set_data_type(io).set_dim(list(y_shape)).set_stride(list(y_stride))
        self.sum, self.sq_sum = g.genstats(input=self.y, compute_data_type=f32, name="stats")
        c = y_shape[1]
        for t in (self.sum, self.sq_sum):
            t.set_output(True).set_data_type(f32).set_dim([1, c, 1, 1]).set_stride([c, 1, c, c])
        self.graph, self.workspace_bytes = _build(g)
        self.stream = None  # the raw CUDA stream the handle was last set to

    def run(self, x, w, y, sums):
        """The workspace stays a tensor even where the graph needs none: pygraph.execute, unlike
        execute_plan_at_index, was not seen on a GPU taking None."""
        follow_stream(self, y.device)
        binding = {self.x: x, self.w: w, self.y: y, self.sum: sums[0], self.sq_sum: sums[1]}
        workspace = torch.empty(max(1, self.workspace_bytes), dtype=torch.uint8, device=y.device)
        self.graph.execute(binding, workspace, handle=self.handle)


_STATS_PLANS: dict = {}


def _stats_plan(x, w, y_shape, y_stride, stride, padding, dilation) -> StatsPlan:
    key = (tuple(x.shape), tuple(x.stride()), tuple(w.shape), tuple(w.stride()), tuple(y_shape), tuple(y_stride),
           x.dtype, tuple(stride), tuple(padding), tuple(dilation))
    plan = _STATS_PLANS.get(key)
    if plan is None:
        plan = _STATS_PLANS[key] = StatsPlan(key)
    return plan


def conv_stats_refusal(x, w, y_shape, y_stride, stride, padding, dilation) -> str | None:
    """Why cuDNN cannot run conv_stats on these (fake or real) tensors, or None; builds and keeps the plan."""
    if tuple(x.shape[2:]) == (1, 1):
        return ONE_PIXEL
    if _cudnn() is None:
        return "nvidia-cudnn-frontend is not installed (pip install resfuse[cudnn])"
    if x.device.type != "cuda":
        return f"cuDNN needs a CUDA device, not {x.device}"
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"{x.dtype} input (fp16/bf16 only: an fp32 conv's TF32 setting is ATen's, not the graph's)"
    try:
        _stats_plan(x, w, y_shape, y_stride, stride, padding, dilation)
    except Exception as e:  # no engine for this graph (check_support) or it cannot be built
        return f"cuDNN has no conv + genstats engine for it ({type(e).__name__}: {str(e)[:120]})"
    return None


def conv_stats(x, w, stride, padding, dilation, y, sums) -> None:
    """y = conv2d(x, w); sums[0] = sum(y), sums[1] = sum(y * y) per channel (fp32 [2, C])."""
    _stats_plan(x, w, y.shape, y.stride(), stride, padding, dilation).run(x, w, y, sums)
