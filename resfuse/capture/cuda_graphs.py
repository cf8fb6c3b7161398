"""CUDA-graph replay of a compiled inference graph (Config.cuda_graphs): small batches are launch-bound.

Entry point: `CudaGraphed(fn)`, wrapped around the rewritten graph by capture/backend.py.

Call 1 runs `fn` eagerly (it builds the kernels) and records each input's address. Call 2 captures: an
input at the same address both times is a parameter or buffer and the graph reads it in place; any other
input gets a static copy that later calls refresh. Every later call copies the changing inputs in, replays,
and returns copies of the outputs, so a caller may keep them across calls. A new shape or dtype, or a
parameter that moved, re-captures. CPU inputs run `fn` as it is.
"""
from __future__ import annotations

import torch


class CudaGraphed:
    def __init__(self, fn):
        self.fn = fn
        self._reset(None)

    def _reset(self, signature) -> None:
        self.signature, self.first_ptrs, self.graph = signature, None, None
        self.static, self.copied, self.outputs = [], [], None

    @staticmethod
    def _signature(args) -> tuple:
        return tuple((a.shape, a.dtype, a.stride(), a.device) if isinstance(a, torch.Tensor) else a for a in args)

    def _capture(self, args) -> None:
        ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]
        self.copied = [i for i, a in enumerate(args)
                       if isinstance(a, torch.Tensor) and ptrs[i] != self.first_ptrs[i]]
        self.static = [a.clone() if i in self.copied else a for i, a in enumerate(args)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn(*self.static)  # warm-up on a side stream, as torch.cuda.graphs advises
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.fn(*self.static)
        self.static_ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in self.static]

    def __call__(self, *args):
        if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            return self.fn(*args)
        signature = self._signature(args)
        if signature != self.signature:
            self._reset(signature)
        if self.first_ptrs is None:
            self.first_ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]
            return self.fn(*args)
        if self.graph is not None and any(
                i not in self.copied and isinstance(a, torch.Tensor) and a.data_ptr() != self.static_ptrs[i]
                for i, a in enumerate(args)):
            self.graph = None  # a parameter or buffer moved: capture again
        if self.graph is None:
            self._capture(args)
        for i in self.copied:
            self.static[i].copy_(args[i])
        self.graph.replay()
        return type(self.outputs)(o.clone() if isinstance(o, torch.Tensor) else o for o in self.outputs)
