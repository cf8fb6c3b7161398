"""The ops no fusion absorbed, compiled by Inductor (Config.remainder): the rest of the graph runs as torch.compile
would run it, with our fused ops as calls it does not look into.

Entry point: `compile_remainder(gm, example_inputs, graph)`, called by capture/backend.py on the rewritten graph.
Our passes see the graph before decomposition (a batch norm is one node there, which is how they find it); the
remainder is retraced here with Inductor's decompositions, where the fused ops are leaves traced through their
fake implementations, then handed to Inductor's graph compiler. Inductor fuses what is left (an SE block's
pooling and gating, layer norms, softmax, a backward's reductions) into its own kernels, reads and writes our
ops' outputs in place, and calls our ops through the dispatcher.
"""
from __future__ import annotations

from unittest import mock

import torch
import torch.fx as fx


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
        return compile_fx_inner(decomposed(gm, example_inputs), list(example_inputs), cudagraphs=BoxedBool(False),
                                is_inference=graph == "inference", is_backward=graph == "backward")
