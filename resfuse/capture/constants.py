"""Parameter-only computations of an inference graph, hoisted out of it and computed again only when a parameter
changes (Config.hoist_constants): merged linears' concatenated weights and biases (passes/merge_linears.py),
autocast's casts of fp32 weights, a weight standardised in the forward.

Entry points: `hoist_constants(gm, example_inputs, static, report, budget) -> Constants | None` and
`budget_bytes(example_inputs)` (what the values may keep allocated: a tenth of the GPU's memory), called by
capture/backend.py on the rewritten inference graph before it is built; `constants.example_inputs` are then the
graph's, and `constants.wrap(fn)` feeds the built graph. A compiled graph may not assume its parameters frozen (an
optimizer step, load_state_dict or an in-place edit between calls), so the captured graph recomputes them on every
call: for BERT-base, 24 concatenations a call. Inductor's freezing computes them once and never looks again.

What is hoisted: each value computed from the graph's static inputs alone (parameters and buffers that the graph
does not write), by functional ATen ops that draw no random numbers, and read, directly or through views, by a
node that is not such a computation. It becomes a new input of the graph. Left in the graph: a value no larger
than a view (the views stay, reading the hoisted values); a value larger than the static inputs it reads, so the
cache holds at most one more copy of the parameters; what a graph output is computed from alone (the caller
would get our cached tensor, or a view of it); and, past the budget, the rest in graph order (with a note).

Before each call, `Constants` compares its sources' identities, addresses and version counters (an in-place
update bumps the counter) with the last call's. On a change it computes the hoisted values again, into the same
tensors, so that a CUDA graph reading them at their addresses stays right. A write through `.data`, which
bypasses the version counter, is not seen. An inference tensor (made under torch.inference_mode) has no counter:
what is computed from one is computed again on every call.
"""
from __future__ import annotations

import itertools
import math
import operator
import weakref

import torch
import torch.fx as fx

from . import cuda_graphs


def budget_bytes(example_inputs) -> int | None:
    """What one graph's hoisted values may keep allocated: a tenth of its GPU's memory (fp32 weights under autocast
    keep an fp16 copy: 170 MB for BERT-base, but 14 GB for a 7B-parameter model, which eager casts a layer at a
    time), or None (no cap) on CPU."""
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda), None)
    return None if device is None else torch.cuda.get_device_properties(device).total_memory // 10


def hoist_constants(gm: fx.GraphModule, example_inputs, static, report, budget: int | None = None) -> Constants | None:
    """Rewrites gm in place: each hoisted value a new placeholder, after the others; in graph order until their
    bytes would pass `budget` (None: no cap). None if nothing qualifies."""
    from torch._dynamo.backends.cudagraphs import find_input_mutations

    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    mutated = find_input_mutations(graph)
    sources = {placeholders[i] for i in static
               if i not in mutated and isinstance(placeholders[i].meta.get("val"), torch.Tensor)}
    const: set[fx.Node] = set()
    for node in graph.nodes:
        if _computable(node, sources, const):
            const.add(node)
    const -= _ancestors(_outputs(graph), const)
    hoisted = [n for n in graph.nodes if n in const and not _is_view(n) and isinstance(n.meta.get("val"), torch.Tensor)
               and _escapes(n, const) and _fits(n, sources, const)]
    sizes = [n.meta["val"].numel() * n.meta["val"].element_size() for n in hoisted]
    within = len(hoisted) if budget is None else sum(1 for total in itertools.accumulate(sizes) if total <= budget)
    if within < len(hoisted):
        report.notes.append(f"inference graph: {len(hoisted) - within} of {len(hoisted)} value(s) computed from "
                            f"parameters alone left in the graph: keeping them would pass {budget / 1e9:.1f} GB")
        hoisted = hoisted[:within]
    if not hoisted:
        return None
    needed = _ancestors(hoisted, const)
    read = [p for p in placeholders if p in needed]
    compute = _subgraph(gm, read, needed, hoisted)
    new_inputs = []
    with graph.inserting_after(placeholders[-1]):
        for node in reversed(hoisted):  # each inserted right after the last old placeholder: reversed keeps order
            ph = graph.placeholder(f"hoisted_{node.name}")
            ph.meta.update({k: node.meta[k] for k in ("val", "tensor_meta") if k in node.meta})
            node.replace_all_uses_with(ph)
            new_inputs.insert(0, node.meta["val"])
    for node in reversed(list(graph.nodes)):
        if node in const and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    kept = sum(v.numel() * v.element_size() for v in new_inputs)
    ops = sorted({getattr(n.target, "overloadpacket", n.target).__name__ for n in hoisted})  # aten.cat.default: cat
    report.rewrites.append(f"inference graph: {len(hoisted)} value(s) computed from parameters alone "
                           f"({', '.join(ops)}) hoisted out of it: computed again only when a parameter changes "
                           f"({kept / 1e6:.1f} MB kept)")
    return Constants(compute, [placeholders.index(p) for p in read], [*example_inputs, *new_inputs],
                     [(tuple(v.shape), v.stride()) for v in new_inputs])


class Constants:
    """The hoisted values of one graph, kept between calls and computed again when a source changed."""

    def __init__(self, compute: fx.GraphModule, source_idx: list[int], example_inputs: list, layouts: list):
        self.compute, self.source_idx, self.example_inputs = compute, source_idx, example_inputs
        self.layouts = layouts  # each value's (shape, strides), as the graph was compiled for them
        self.all_idx = list(range(len(source_idx)))
        self.refs, self.ptrs, self.versions, self.values = [], [], [], None

    def values_for(self, inputs) -> list[torch.Tensor]:
        sources = [inputs[i] for i in self.source_idx]
        now = cuda_graphs.versions(sources)
        if (self.values is None or now is None or now != self.versions
                or not all(r() is t for r, t in zip(self.refs, sources))
                or not cuda_graphs.same_addresses(sources, self.ptrs, self.all_idx)):
            self._refresh(sources)
        return self.values

    def _refresh(self, sources) -> None:
        with torch.no_grad():
            new = self.compute(*sources)
            if self.values is None:
                self.values = [_laid_out(v, *layout) for v, layout in zip(new, self.layouts)]
            else:  # in place: a CUDA graph reads them at their addresses
                self.values = [old.copy_(v) if old.shape == v.shape else _laid_out(v, *layout)
                               for old, v, layout in zip(self.values, new, self.layouts)]
        self.refs = [weakref.ref(t) for t in sources]
        self.ptrs = [t.data_ptr() for t in sources]
        self.versions = cuda_graphs.versions(sources)

    def wrap(self, fn):
        """fn (boxed: the built graph, which takes its hoisted values after its own inputs) fed by this cache."""
        def run(inputs: list):
            inputs.extend(self.values_for(inputs))
            return fn(inputs)

        run._boxed_call = True
        return run


def _laid_out(v: torch.Tensor, shape, strides) -> torch.Tensor:
    """v with the strides the graph was compiled for (Inductor asserts its inputs' sizes and strides)."""
    if v.stride() == strides or v.shape != shape:
        return v
    return torch.empty_strided(shape, strides, dtype=v.dtype, device=v.device).copy_(v)


def _computable(node: fx.Node, sources: set, const: set) -> bool:
    """Is node a functional, non-random ATen op (or an item of one's outputs) whose inputs are all static inputs
    or such nodes, with static shapes?"""
    if node.op != "call_function":
        return False
    if node.target is not operator.getitem:
        op = node.target
        if (not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable
                or torch.Tag.nondeterministic_seeded in op.tags):
            return False
    inputs = node.all_input_nodes
    if not inputs or not all(i in sources or i in const for i in inputs):
        return False
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return all(isinstance(v, torch.Tensor) and not any(isinstance(s, torch.SymInt) for s in v.shape) for v in vals)


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return _is_view(node.args[0])
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _escapes(node: fx.Node, const: set) -> bool:
    """Is node read, directly or through views, by a node that is not computed from static inputs alone?"""
    return any(u not in const or (_is_view(u) and _escapes(u, const)) for u in node.users)


def _outputs(graph: fx.Graph) -> list[fx.Node]:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    return out.all_input_nodes


def _ancestors(nodes, const: set) -> set[fx.Node]:
    """nodes and every node they are computed from, through nodes of const (static inputs included)."""
    seen, todo = set(), [n for n in nodes if n in const]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo += [i for i in n.all_input_nodes if i in const] if n.op == "call_function" else []
        seen.update(i for i in n.all_input_nodes if i.op == "placeholder")
    return seen


def _fits(node: fx.Node, sources: set, const: set) -> bool:
    """Is the hoisted value no larger than the static inputs it is computed from (no broadcast kept)?"""
    read = [s for s in _ancestors([node], const) if s in sources]
    return math.prod(node.meta["val"].shape) <= sum(math.prod(s.meta["val"].shape) for s in read)


def _subgraph(gm: fx.GraphModule, read: list[fx.Node], needed: set, hoisted: list[fx.Node]) -> fx.GraphModule:
    """The hoisted values' computation (the nodes `needed`) as a graph of its own: the static inputs it reads
    (`read`) -> the values."""
    sub = fx.Graph()
    env = {s: sub.placeholder(s.name) for s in read}
    for node in gm.graph.nodes:
        if node in needed and node not in env:
            env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[h] for h in hoisted))
    return fx.GraphModule(gm, sub)
