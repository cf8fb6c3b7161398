"""The custom ops that the rewritten graph calls: fused.py (inference anchors), chain.py (two fused 1x1 convs, the
second reading the first's output), shortcut.py (a fused 1x1 conv whose residual is another's output), training.py
(training anchors), pooling.py (max pooling), padding.py (a 3-channel image padded for cuDNN), image_conv.py (a
stem's conv over its image), registered by library.py.

The torch.library ops are what the passes put in the graph: they have schemas and fake implementations, so
a rewritten graph can be traced, checked, exported and compiled by Inductor (which calls them through the
dispatcher). With an eager remainder, `lower_to_impls(gm)`, the backend's last step, points each call at the
op's plain Python implementation instead: the dispatcher round trip of a torch.library.custom_op cost ~70-150 us
of host time per call (bench/host_ops.py, H200), which a training step or an un-graphed small batch pays on
every fused op; library.py's plainer registration costs less (11 against 28 us on the CI CPU), not nothing.
"""
import torch.fx as fx

from .fused import (PATHS, conv2d, conv2d_aux, conv2d_aux_impl, conv2d_impl, conv_out_format, gemm, gemm_aux,
                    gemm_aux_impl, gemm_impl)
from .chain import conv2d_chain, conv2d_chain_impl
from .shortcut import conv2d_shortcut, conv2d_shortcut_impl
from .padding import pad_channels, pad_channels_impl
from .image_conv import image_conv, image_conv_impl
from .pooling import (max_pool2d, max_pool2d_backward, max_pool2d_backward_impl, max_pool2d_epilogue,
                      max_pool2d_epilogue_impl, max_pool2d_impl)
from .training import (batch_norm, batch_norm_backward, batch_norm_backward_dual, batch_norm_backward_dual_impl,
                       batch_norm_backward_impl, batch_norm_impl, batch_norm_stats, batch_norm_stats_impl,
                       conv2d_dgrad, conv2d_dgrad_impl, conv2d_dgrad_stats, conv2d_dgrad_stats_impl, conv2d_stats,
                       conv2d_stats_impl)

__all__ = ["PATHS", "conv2d", "conv2d_aux", "conv2d_chain", "conv2d_shortcut", "gemm", "gemm_aux", "conv_out_format",
           "batch_norm", "batch_norm_stats", "conv2d_stats", "conv2d_dgrad", "conv2d_dgrad_stats", "batch_norm_backward",
           "batch_norm_backward_dual", "max_pool2d", "max_pool2d_epilogue", "max_pool2d_backward", "pad_channels",
           "image_conv", "lower_to_impls"]

import torch  # noqa: E402  (after the ops are defined, so torch.ops.resfuse has them)

IMPLS = {torch.ops.resfuse.conv2d.default: conv2d_impl, torch.ops.resfuse.gemm.default: gemm_impl,
         torch.ops.resfuse.conv2d_aux.default: conv2d_aux_impl,
         torch.ops.resfuse.conv2d_chain.default: conv2d_chain_impl, torch.ops.resfuse.gemm_aux.default: gemm_aux_impl,
         torch.ops.resfuse.conv2d_shortcut.default: conv2d_shortcut_impl,
         torch.ops.resfuse.batch_norm.default: batch_norm_impl,
         torch.ops.resfuse.batch_norm_stats.default: batch_norm_stats_impl,
         torch.ops.resfuse.conv2d_stats.default: conv2d_stats_impl,
         torch.ops.resfuse.conv2d_dgrad.default: conv2d_dgrad_impl,
         torch.ops.resfuse.conv2d_dgrad_stats.default: conv2d_dgrad_stats_impl,
         torch.ops.resfuse.batch_norm_backward.default: batch_norm_backward_impl,
         torch.ops.resfuse.batch_norm_backward_dual.default: batch_norm_backward_dual_impl,
         torch.ops.resfuse.max_pool2d.default: max_pool2d_impl,
         torch.ops.resfuse.max_pool2d_epilogue.default: max_pool2d_epilogue_impl,
         torch.ops.resfuse.max_pool2d_backward.default: max_pool2d_backward_impl,
         torch.ops.resfuse.pad_channels.default: pad_channels_impl,
         torch.ops.resfuse.image_conv.default: image_conv_impl}


def lower_to_impls(gm: fx.GraphModule) -> fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in IMPLS:
            node.target = IMPLS[node.target]
    gm.recompile()
    return gm
