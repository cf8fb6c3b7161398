"""Give scaled_dot_product_attention the mask eager would: none where it is all True, else one its fused kernels
accept. Runs on the dynamo graph, before aot_autograd: that trace picks the attention kernel, and decomposes the
call into the fp32 math path when no fused kernel takes the arguments.

Entry points: `drop_all_true_masks(gm, report) -> gm`, then `contiguous_attention_masks(gm, report) -> gm`.

Without a padding mask from the caller, HF transformers (5.17) builds an all-True bidirectional mask under
torch.compile from constants (`arange(S)[None, None, :, None] >= 0`, expanded to [B, 1, S, S]), where eager
checks the values and passes no mask. Given a mask, cuDNN attention reads it as an additive bias for every
head: on an H100, ViT-B at bs256 spent 541 us a call against eager's 174 (bench/attention_in_graph.py). A mask
computed from constants alone is evaluated once, here; if every value is True (or, for an additive mask, 0) it
is dropped, which changes no result. A mask that depends on an input (a real padding mask) is kept.

Where a mask stays, HF transformers builds it under torch.compile as an expanded bool tensor whose last dim has
stride 0. Flash, memory-efficient and cuDNN attention all need the mask's last dim contiguous, so the trace fell
back to math SDPA: q, k and v upcast to fp32, two fp32 bmm and an fp32 softmax per layer, 4x slower than eager
on BERT-base (bench/sdpa_probe.py, H200). One `.contiguous()` per mask node (shared by every layer that uses it)
restores a fused kernel; the mask's values, and so the result, do not change.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily

SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def _mask(node: fx.Node):
    return node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)


BROADCASTS = ("expand", "contiguous")  # methods that keep every value of their input; their other args are sizes


def _constant_base(mask: fx.Node) -> fx.Node | None:
    """The mask before broadcasting, if it is computed from constants alone (no input, parameter or buffer)."""
    base = mask
    while base.op == "call_method" and base.target in BROADCASTS:
        base = base.args[0]
    computed = all(n.op in ("call_function", "call_method") for n in _ancestors(base) | {base})
    return base if computed else None


def _evaluate(gm: fx.GraphModule, node: fx.Node):
    """Run the constant subgraph that computes `node` (it has no inputs) on real tensors; None if it fails."""
    sub, env, needed = fx.Graph(), {}, _ancestors(node) | {node}
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[node])
    try:
        with unset_fake_temporarily():
            return fx.GraphModule(gm, sub)()
    except (RuntimeError, TypeError, ValueError):  # a mask we cannot evaluate is kept as it is
        return None


def _ancestors(node: fx.Node) -> set:
    found, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


def _erase_if_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase a dropped mask and whatever computed only it (constants: nothing with side effects)."""
    if node.users or node.op not in ("call_function", "call_method"):
        return  # never a graph input, even one only a size was read from
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for n in inputs:
        _erase_if_unused(graph, n)


def _all_pass(value) -> bool:
    """Does this mask let every query attend to every key? (bool: all True; additive: all zero)"""
    if not isinstance(value, torch.Tensor):
        return False
    return bool(value.all()) if value.dtype == torch.bool else bool((value == 0).all())


def drop_all_true_masks(gm: fx.GraphModule, report) -> fx.GraphModule:
    verdicts: dict[fx.Node, bool] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA:
            continue
        mask = _mask(node)
        if not isinstance(mask, fx.Node):
            continue
        if mask not in verdicts:
            base = _constant_base(mask)
            verdicts[mask] = base is not None and _all_pass(_evaluate(gm, base))
            if verdicts[mask]:
                report.rewrites.append(f"attention mask {mask.name} is built from constants and lets every query "
                                       "see every key: dropped, as eager transformers passes none")
        if verdicts[mask]:
            if "attn_mask" in node.kwargs:
                node.update_kwarg("attn_mask", None)
            else:
                node.update_arg(3, None)
    for mask in [m for m, dropped in verdicts.items() if dropped]:
        _erase_if_unused(gm.graph, mask)
    gm.graph.lint()
    gm.recompile()
    return gm


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
