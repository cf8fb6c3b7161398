"""The legality rules that both fusion passes share. Each rule returns None (legal) or the reason it refuses.

Rules (shared/design.md): single consumer; no path from the producer to the other operand (no cycle); equal
shape and dtype or a supported broadcast; no aliasing with the producer's inputs; at most one absorbed add
per producer; no mutation or control dependency; static shapes but for a dynamic batch dim, and a supported
dtype.
"""
from __future__ import annotations

import torch
import torch.fx as fx

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_RESIDUALS = 2  # tensor operands that are not per-channel vectors


def val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def hint(size) -> int:
    """An int for a size that may be symbolic (a dynamic batch): the size seen at capture, read without adding a
    guard, for estimates only (the report's bytes and peaks). An unbacked size, which has none, counts as 0."""
    if isinstance(size, torch.SymInt):
        return int(size.node.hint) if size.node.hint is not None else 0
    return int(size)


def static_tensor(node: fx.Node) -> str | None:
    v = val(node)
    if v is None:
        return f"{node.name} has no tensor metadata"
    if any(not isinstance(d, int) for d in (*v.shape[1:], *v.stride())):
        return f"dynamic shape {tuple(v.shape)}: only the leading (batch) dim may vary"
    return None


def shape_param(shape) -> list[int]:
    """A shape as a fused op's argument: a dynamic leading dim (static_tensor allows no other) becomes -1, which
    the op resolves from its inputs at run time (ops.fused.with_batch)."""
    return [d if isinstance(d, int) else -1 for d in shape]


def supported_dtype(node: fx.Node) -> str | None:
    v = val(node)
    if v is not None and v.dtype not in SUPPORTED_DTYPES:
        return f"dtype {v.dtype} not supported (fp16, bf16, fp32)"
    return None


def sole_consumer(node: fx.Node) -> str | None:
    users = list(node.users)
    if len(users) != 1:
        return f"{node.name} has {len(users)} consumers ({', '.join(u.name for u in users)})"
    return None


def mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def no_mutation(*nodes: fx.Node) -> str | None:
    """No node involved is mutated in place or ordered by a side effect (functionalised graphs keep these)."""
    for n in nodes:
        if not isinstance(n, fx.Node):
            continue
        if mutates(n):
            return f"{n.name} mutates its inputs"
        hit = next((u.name for u in n.users if mutates(u)), None)
        if hit:
            return f"{n.name} is mutated by {hit}"
    return None


def depends_on(node: fx.Node, producer: fx.Node) -> bool:
    """Is there a path producer -> ... -> node? Only nodes after `producer` in graph order can be on it."""
    order = {n: i for i, n in enumerate(producer.graph.nodes)}
    start = order[producer]
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is producer:
            return True
        if n in seen or order.get(n, -1) <= start:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes)
    return False


def no_cycle(operand: fx.Node, producer: fx.Node) -> str | None:
    if isinstance(operand, fx.Node) and depends_on(operand, producer):
        return f"operand {operand.name} depends on the producer {producer.name} (fusing would form a cycle)"
    return None


def _alias_root(node: fx.Node) -> fx.Node:
    """Follow view ops back to the tensor that owns the storage."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def no_alias(operand: fx.Node, producer_inputs) -> str | None:
    """An add-to-output operand becomes the producer's initial output: it must not share storage with the
    producer's inputs, or accumulating into it would overwrite what the producer still reads (OneFlow)."""
    root = _alias_root(operand)
    for i in producer_inputs:
        if isinstance(i, fx.Node) and _alias_root(i) is root:
            return f"operand {operand.name} aliases the producer's input {i.name}"
    return None


def broadcast_kind(operand: fx.Node, out: torch.Tensor, channel_dim: int) -> tuple[str | None, str | None]:
    """(kind, reason): how `operand` broadcasts onto `out` — "c", "nc", "full" — or why it can't."""
    from ..epilogue import operand_kind, rows3

    v = val(operand)
    if v is None:
        return None, "operand has no tensor metadata"
    try:
        if torch.broadcast_shapes(v.shape, out.shape) != out.shape:
            return None, f"operand shape {tuple(v.shape)} broadcasts the output {tuple(out.shape)} larger"
        kind = operand_kind(rows3(v, out.shape, channel_dim))
    except RuntimeError as e:
        return None, f"operand shape {tuple(v.shape)} does not broadcast to {tuple(out.shape)}: {e}"
    if v.dtype not in SUPPORTED_DTYPES:
        return None, f"operand dtype {v.dtype} not supported"
    if kind == "full" and v.dtype != out.dtype:
        return None, f"operand dtype {v.dtype} differs from output dtype {out.dtype}"
    return kind, None


def same_layout(operand: fx.Node, out: torch.Tensor, dtype: torch.dtype | None = None) -> str | None:
    """FuseAddToOutput needs the operand to be laid out like the output it initialises (`dtype`: the output's
    dtype when the add promotes it, fp16 + fp32 -> fp32)."""
    v = val(operand)
    if v is None or tuple(v.shape) != tuple(out.shape):
        return f"shape {None if v is None else tuple(v.shape)} differs from output {tuple(out.shape)}"
    if v.dtype != (dtype or out.dtype):
        return f"dtype {v.dtype} differs from output dtype {dtype or out.dtype}"
    if not same_strides(v, out):
        return f"strides {v.stride()} differ from output strides {out.stride()}"
    return None


def same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do two tensors of one shape lay out their elements alike? A dim of size 1 has no layout, and its stride
    is whatever the producer chose (a 1x1-pixel conv output's, for one), as Inductor's own stride asserts
    allow."""
    return tuple(a.shape) == tuple(b.shape) and all(
        sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n != 1)


def memory_format(t: torch.Tensor) -> torch.memory_format | None:
    """channels_last or contiguous_format, where t's strides are theirs (a 4-D t); else None."""
    for fmt in (torch.channels_last, torch.contiguous_format):
        if t.dim() == 4 and same_strides(t, torch.empty(t.shape, device="meta", memory_format=fmt)):
            return fmt
    return None


def promotes(add: fx.Node, producer_out: torch.Tensor) -> bool:
    """Is `add` a mixed-precision add whose fp32 result an fp16/bf16 producer can store directly?"""
    v = val(add)
    return (v is not None and producer_out is not None and v.dtype == torch.float32
            and producer_out.dtype in (torch.float16, torch.bfloat16))


def first(*reasons) -> str | None:
    """The first refusal among already-evaluated rules."""
    return next((r for r in reasons if r), None)
