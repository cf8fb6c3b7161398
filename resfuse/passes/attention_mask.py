"""Give scaled_dot_product_attention a mask that its fused kernels accept. Runs on the dynamo graph, before
aot_autograd: that trace picks the attention kernel, and decomposes the call into the fp32 math path when
no fused kernel takes the arguments.

Entry point: `contiguous_attention_masks(gm, report) -> gm`. HF transformers builds its bidirectional mask
under torch.compile as an expanded bool tensor whose last dim has stride 0 (it skips the mask in eager).
Flash, memory-efficient and cuDNN attention all need the mask's last dim contiguous, so the trace fell back
to math SDPA: q, k and v upcast to fp32, two fp32 bmm and an fp32 softmax per layer, 4x slower than eager
on BERT-base (bench/sdpa_probe.py, H200). One `.contiguous()` per mask node (shared by every layer that
uses it) restores a fused kernel; the mask's values, and so the result, do not change.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def _mask(node: fx.Node):
    return node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)


def contiguous_attention_masks(gm: fx.GraphModule, report) -> fx.GraphModule:
    made: dict[fx.Node, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA:
            continue
        mask = _mask(node)
        val = mask.meta.get("example_value") if isinstance(mask, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or val.stride(-1) == 1 or val.shape[-1] == 1:
            continue
        if mask not in made:
            with gm.graph.inserting_after(mask):
                dense = gm.graph.call_method("contiguous", (mask,))
            dense.meta["example_value"] = val.contiguous()
            made[mask] = dense
            report.rewrites.append(f"attention mask {mask.name} {tuple(val.shape)} made contiguous (last-dim "
                                   f"stride {val.stride(-1)}): SDPA can use a fused kernel instead of fp32 math")
        if "attn_mask" in node.kwargs:
            node.update_kwarg("attn_mask", made[mask])
        else:
            node.update_arg(3, made[mask])
    gm.graph.lint()
    gm.recompile()
    return gm
