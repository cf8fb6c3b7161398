"""The ops no fusion absorbed, compiled by Inductor (Config.remainder): the rest of the graph runs as torch.compile
would run it, with our fused ops as calls it does not look into.

Entry point: `compile_remainder(gm, example_inputs, graph)`, called by capture/backend.py on the rewritten graph.
Our passes see the graph before decomposition (a batch norm is one node there, which is how they find it); the
remainder is retraced here with Inductor's decompositions, where the fused ops are leaves traced through their
fake implementations, its closing state updates batched (`batched_input_updates`), then handed to Inductor's
graph compiler. Inductor fuses what is left (an SE block's pooling and gating, layer norms, softmax, a backward's
reductions) into its own kernels, reads and writes our ops' outputs in place, and calls our ops through the
dispatcher.
"""
from __future__ import annotations

import collections
from unittest import mock

import torch
import torch.fx as fx

aten = torch.ops.aten


def wanted(config_remainder: str, example_inputs) -> bool:
    """Does this graph's remainder go to Inductor? "auto": graphs on CUDA (on CPU our kernels run under the
    interpreter, for tests, and Inductor's C++ compile would cost more than it saves)."""
    if config_remainder == "auto":
        return any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    return config_remainder == "inductor"


def decomposed(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """gm retraced with Inductor's decompositions, as aot_autograd traces for torch.compile; the fused ops stay
    single nodes (custom ops are traced through their fake implementations)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t
                for t in example_inputs]
        return make_fx(gm, decomposition_table=select_decomp_table())(*args)


def compile_remainder(gm: fx.GraphModule, example_inputs, graph: str):
    """The rewritten graph compiled by Inductor, without its CUDA graphs (capture/cuda_graphs.py wraps the result
    as it wraps an eager graph). Boxed: called with a list of inputs, which it empties."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.exc import OperatorIssue
    from torch._inductor.utils import BoxedBool

    # A lowering error prints the op's arguments, IR trees that share subtrees: on a ResNet-50 backward at bs256
    # (H100, torch 2.11) printing them ran for minutes. The caller falls back on any error and keeps 300
    # characters of its message, so name the op only.
    op_only = staticmethod(lambda target, args, kwargs: f"  target: {target}")
    with mock.patch.object(OperatorIssue, "operator_str", op_only):
        return compile_fx_inner(batched_input_updates(decomposed(gm, example_inputs)), list(example_inputs),
                                cudagraphs=BoxedBool(False),
                                is_inference=graph == "inference", is_backward=graph == "backward")


def batched_input_updates(gm: fx.GraphModule) -> fx.GraphModule:
    """aot_autograd closes a graph that updates module state with one copy_ per updated input: in a ResNet-50
    training forward, each batch norm's running mean, running var and num_batches_tracked, 159 copies of a few
    hundred bytes, each its own Inductor kernel (about 1.5 us of launch and idle apiece in a CUDA graph). The
    graph's closing run of such copies becomes one _foreach_copy_ per (destination dtype, source dtype), which
    Inductor lowers to one foreach kernel: the same stores, the counters' `+ 1` computed inside it. Only the
    closing run, so no op reads an input between its copy and the end; the refusal and CUDA-graph checks, which
    read mutations from each node's schema, see the graph before this."""
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    tail = []
    node = output.prev
    while (node.op == "call_function" and node.target is aten.copy_.default and len(node.args) == 2
           and not node.kwargs and not node.users and node.args[0].op == "placeholder"):
        tail.append(node)
        node = node.prev
    groups = collections.defaultdict(list)
    for copy in reversed(tail):
        groups[(copy.args[0].meta["val"].dtype, copy.args[1].meta["val"].dtype)].append(copy)
    batched = [group for group in groups.values() if len(group) > 1]
    for group in batched:
        with graph.inserting_before(output):
            graph.call_function(aten._foreach_copy_.default, ([c.args[0] for c in group], [c.args[1] for c in group]))
        for copy in group:
            graph.erase_node(copy)
    if batched:
        graph.lint()
        gm.recompile()
    return gm
