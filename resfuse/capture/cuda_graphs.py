"""CUDA-graph replay of compiled graphs (Config.cuda_graphs): small batches and training steps are launch-bound.

Entry points, used by capture/backend.py: `wanted(cuda_graphs, graph, example_inputs)` (Config.cuda_graphs
applied to one graph), `refusal(gm, graph)` (why a graph cannot be replayed, or None) and
`wrap(fn, gm, inputs, graph, refusal, graphed)` (fn: gm built, boxed), which puts an inference graph in
`CudaGraphed` and training's forward and backward graphs under torch's CUDA graph trees (`graph_tree`).

Inference (CudaGraphed):

Call 1 runs `fn` eagerly (it builds the kernels) and records each input's address. Call 2 captures: an
input at the same address both times is a parameter or buffer and the graph reads it in place; any other
input gets a static copy that later calls refresh. Every later call copies the changing inputs in, replays,
and returns outputs of its own, so a caller may keep them across calls, as in eager. Each input signature
(shapes, dtypes, strides) has its own graph, so a dynamic batch alternating between sizes replays without
capturing again; a parameter that moved re-captures. CPU inputs run `fn` as it is.

The outputs a call returns (`_Handout`): a second and a third graph of the signature (HANDOUTS), captured on the
first later calls that find none free, end with their outputs copied into buffers of their own, and a call hands
the caller those buffers once nothing the caller holds reads them any more (no tensor on their storage, nor the
storage's Python object). A loop `out = model(x)` holds the last call's output while it makes the next, so two
graphs alternate. A caller that keeps every output finds neither free: the first graph replays, and its outputs are
copied after it, as before. Outputs over 64 MB in all (HANDOUT_BYTES) are always copied so: two kept buffers would
hold that memory for good, and there the copy itself, not its launch, is the cost. The copy inside the graph saves
the host the copy's launch and allocation, and the GPU the gap before it: on an H100 at batch 1, 31-34 us of the
host's 184-228 us a call (ResNet-50, MobileNetV3-L; bench/host_ab.py) and 2-3 us of ResNet-50's 263 us on the GPU
(BENCHMARKS.md, forty-fourth session).

A captured graph must reproduce the warm-up's outputs on the same inputs before it serves a call (`mismatch`): a
replay that ran its kernels out of order computed ResNet-50 at batch 1 wrong on an H200 (relative error 1.2 on
every replay, the first call right; thirty-eighth session). A graph that does not is dropped, and its signature
runs without CUDA graphs from then on, said once and kept in the report's errors.
"""
from __future__ import annotations

import operator
import sys

import torch
import torch.fx as fx


class _Capture:
    """The captured graph of one input signature (shapes, dtypes, strides, devices), and what replaying it needs."""

    def __init__(self):
        self.first_ptrs, self.graph, self.outputs = None, None, None
        self.static, self.copied = [], []
        self.fixed_ptrs, self.fixed_idx, self.fixed_objs = None, [], None  # see replays()
        self.not_fixed, self.scalar_idx, self.scalars, self.copied_sig = [], [], [], ()
        self.folds = None  # providers.fold_bn.FoldWatch: batch norms folded into conv weights that the graph reads
        self.tickets = None  # kernels.split_k.graph_tickets: the graph's split launches' tickets, kept with it
        self.refused = None  # why this signature runs without its graph (its replay did not match the warm-up)
        self.handouts: list[_Handout] = []  # the graphs whose outputs a call hands out (CudaGraphed._serve)
        self.handouts_refused = None  # why none is captured (handout_refusal, or one's replay did not match)

    def remember(self, args: tuple, ptrs: list) -> None:
        """What moved() and replays() compare: the inputs read in place (their addresses and objects; the
        others masked out), the non-tensor inputs' values and the copied inputs' signature."""
        self.scalar_idx = [i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
        self.scalars = [args[i] for i in self.scalar_idx]
        self.not_fixed = [*self.copied, *self.scalar_idx]
        self.fixed_ptrs = _masked(ptrs, self.copied)
        self.fixed_idx = sorted(set(range(len(args))) - set(self.not_fixed))
        self.fixed_objs = _masked(args, self.not_fixed)
        self.copied_sig = _signature([args[i] for i in self.copied])

    def moved(self, ptrs: list) -> bool:
        """Has an input this graph reads in place moved (a parameter re-allocated)? For a call whose whole
        signature is this graph's."""
        return _masked(ptrs, self.copied) != self.fixed_ptrs

    def replays(self, args: tuple) -> bool:
        """Can this graph replay `args` without their whole signature being hashed? Each input it reads in
        place must be the same tensor object at the same address as at capture (a new view of that buffer at
        another size is another object), the non-tensor inputs the same values, and the inputs it copies must
        have its shapes, strides and dtypes. A model's hundreds of parameters make this the host's cost per
        call at batch 1: an identity test per input and torch's C++ address check, both looped in C, no Python
        loop over the inputs. (Comparing lists of the inputs' ids instead cost 106 us a call for MobileNetV3's 267
        inputs on the H100 machine's host, a third of a bs1 call; bench/replay_gaps.py.)"""
        return (self.fixed_ptrs is not None and len(args) == len(self.fixed_ptrs)
                and all(map(operator.is_, _masked(args, self.not_fixed), self.fixed_objs))
                and [args[i] for i in self.scalar_idx] == self.scalars
                and same_addresses(args, self.fixed_ptrs, self.fixed_idx)
                and _signature([args[i] for i in self.copied]) == self.copied_sig)


class _Handout:
    """A graph of one signature that runs the captured call, then copies its outputs into `buffers`, tensors of
    their own outside the graphs' memory pool, which a call returns (as detached aliases). Replayed only while
    `free()`: the caller holds nothing that reads the buffers, by their storages' use counts (a tensor or a view on
    one) and the Python refcounts of their storage objects (`untyped_storage()`), both as they were when only we
    held them. Its graph's own outputs are read by its copies alone, so they may share the pool's memory with the
    other graphs of the signature."""

    def __init__(self, graph, buffers: list, tickets):
        self.graph, self.buffers, self.tickets = graph, buffers, tickets
        self.storages = [b.untyped_storage() for b in buffers if isinstance(b, torch.Tensor)]
        self.alone = self.holders()

    def holders(self) -> list:
        return [(torch._C._storage_Use_Count(s._cdata), sys.getrefcount(s)) for s in self.storages]

    def free(self) -> bool:
        return self.holders() == self.alone

    def outputs(self, kind):
        return kind(b.detach() if isinstance(b, torch.Tensor) else b for b in self.buffers)


def handout_refusal(outputs, limit: int) -> str | None:
    """Why a signature's calls copy their outputs after the replay instead of handing out buffers (None: they may
    hand out): outputs larger than `limit` bytes in all, where two buffers kept for handing out would hold memory
    that a copy per call gives back (and the copy, not its launch, is the cost), or a torch that cannot count a
    storage's users."""
    if getattr(torch._C, "_storage_Use_Count", None) is None:
        return "this torch has no torch._C._storage_Use_Count"
    size = sum(o.numel() * o.element_size() for o in outputs if isinstance(o, torch.Tensor))
    return f"outputs of {size} bytes, over {limit}" if size > limit else None


def same_addresses(args: tuple, ptrs: list, idx: list) -> bool:
    """args[i].data_ptr() == ptrs[i] for each i in idx: in C++ where torch has it (its CUDA builds; CUDA graph
    trees check their static inputs with it), else in Python."""
    check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if check is not None:
        return check(list(args), ptrs, idx)
    return all(args[i].data_ptr() == ptrs[i] for i in idx)


def _masked(values, masked) -> list:
    """A list copy of `values` (a list or a tuple) with None at the indices `masked`."""
    values = list(values)
    for i in masked:
        values[i] = None
    return values


def versions(tensors) -> list | None:
    """The tensors' version counters (what a derived value cached across calls compares: providers/fold_bn.py's
    folds, capture/constants.py's hoisted values), or None where one is an inference tensor (made under
    torch.inference_mode), which has none: what is derived from it is then derived again on every call. No check
    per tensor before the read: FoldWatch reads 265 counters before each ResNet-50 bs1 replay."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def mismatch(outputs, expected, tol: float = 1e-3) -> str | None:
    """How the graph's outputs differ from the warm-up's on the same inputs, or None where they agree: the same
    kernels on the same inputs, so only a nondeterministic kernel's last bits may differ (tol, a relative norm over
    the finite values; NaN or an infinity where the warm-up has the same counts as agreeing)."""
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        if not isinstance(out, torch.Tensor):
            continue
        if not out.is_floating_point():
            if not torch.equal(out, ref):
                return f"output {i} differs"
            continue
        a, b = out.float(), ref.float()
        if not torch.equal(a.isnan(), b.isnan()):
            return f"output {i} has NaN where the un-graphed run has none, or the reverse"
        ok = b.isfinite()
        if not torch.equal(a.isinf(), b.isinf()) or not torch.equal(a[b.isinf()], b[b.isinf()]):
            return f"output {i} has an infinity where the un-graphed run has another value, or the reverse"
        err = ((a - b)[ok].norm() / b[ok].norm().clamp_min(1e-30)).item()
        if not err <= tol:
            return f"output {i} differs by a relative error of {err:.1e}"
    return None


def _signature(args) -> tuple:
    return tuple((a.shape, a.dtype, a.stride(), a.device) if isinstance(a, torch.Tensor) else a for a in args)


def _ptrs(args) -> list:
    """Each tensor input's address; other inputs (a dynamic batch's size) stand for themselves."""
    return [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]


def on_cuda(values) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in values)


class CudaGraphed:
    """Boxed, like `fn`: called with a list of inputs, which it empties. One graph per input signature (a
    dynamic batch brings several), at most MAX_SIGNATURES of them; past that the least recently used goes.
    The last graph replayed is tried first, without hashing every input's signature."""
    _boxed_call = True
    MAX_SIGNATURES = 8
    HANDOUTS = 2  # graphs a signature hands its outputs out from (_Handout); 0: each call copies them after its replay
    HANDOUT_BYTES = 1 << 26  # outputs larger in all get no handouts (handout_refusal)

    def __init__(self, fn, report=None):
        self.fn, self.report = fn, report
        self.captures: dict[tuple, _Capture] = {}  # least recently used first
        self.last: _Capture | None = None

    @property
    def graph(self):
        """The most recently used signature's graph (None before its second call)."""
        return next(reversed(self.captures.values())).graph if self.captures else None

    _on_cuda = staticmethod(on_cuda)  # (tests replace it)

    def _capture(self, cap: _Capture, args, ptrs: list) -> None:
        from ..kernels import split_k  # not at import, as below
        from ..providers.fold_bn import FoldWatch, recording_folds  # not at import: it would import the kernels

        cap.handouts = []  # they replay the graph this one replaces
        cap.copied = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and ptrs[i] != cap.first_ptrs[i]]
        copied = set(cap.copied)
        cap.static = [a.clone() if i in copied else a for i, a in enumerate(args)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # Blocks the allocator caches for one stream serve neither another stream nor a graph's private pool:
        # the first call's blocks, then the side-stream warm-up's, go back to the device before the next step
        # allocates, or the capture's peak is all three (ResNet-50 bs256: 2.86 GB reserved against eager's 2.14;
        # bench/inference_memory.py). Once per captured signature, so the cost is a few cudaFree.
        torch.cuda.empty_cache()
        with recording_folds() as folds:
            with torch.cuda.stream(side):
                expected = self.fn(list(cap.static))  # warm-up on a side stream, as torch.cuda.graphs advises
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.empty_cache()
            cap.graph = torch.cuda.CUDAGraph()
            device = next(a.device for a in args if isinstance(a, torch.Tensor))  # on_cuda(args) found one
            with split_k.graph_tickets(device) as cap.tickets, torch.cuda.graph(cap.graph):
                cap.outputs = self.fn(list(cap.static))
        cap.folds = FoldWatch(folds) if folds else None
        cap.handouts_refused = handout_refusal(cap.outputs, self.HANDOUT_BYTES)
        cap.remember(args, ptrs)
        cap.graph.replay()
        if why := mismatch(cap.outputs, expected):
            cap.graph, cap.outputs, cap.tickets, cap.static, cap.refused = None, None, None, [], why
            self._say(f"a CUDA graph's replay did not reproduce its un-graphed run ({why}); calls of input shapes "
                      f"{[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)][:3]}... run without CUDA "
                      "graphs. This is a resfuse bug: please report it")

    def _say(self, message: str) -> None:
        print(f"resfuse: {message}", flush=True)
        if self.report is not None:
            self.report.errors.append(message)

    def _capture_handout(self, cap: _Capture) -> _Handout | None:
        """A new _Handout of cap's signature, its buffers holding this call's outputs (the static inputs hold this
        call's); None where its replay does not reproduce the first graph's (then none is captured again)."""
        from ..kernels import split_k

        buffers = [torch.empty_like(o) if isinstance(o, torch.Tensor) else o for o in cap.outputs]
        graph = torch.cuda.CUDAGraph()
        device = next(o.device for o in cap.outputs if isinstance(o, torch.Tensor))
        with split_k.graph_tickets(device) as tickets, torch.cuda.graph(graph, pool=cap.graph.pool()):
            outputs = self.fn(list(cap.static))
            for buffer, out in zip(buffers, outputs):
                if isinstance(buffer, torch.Tensor):
                    buffer.copy_(out)
        del outputs  # freed in the pool: read by the graph's own copies alone
        cap.graph.replay()
        expected = [o.clone() if isinstance(o, torch.Tensor) else o for o in cap.outputs]
        graph.replay()
        if why := mismatch(buffers, expected):
            cap.handouts_refused = why
            self._say(f"a CUDA graph that copies its outputs out did not reproduce the graph it copies ({why}); "
                      "its calls copy the outputs after the replay instead. This is a resfuse bug: please report it")
            return None
        cap.handouts.append(_Handout(graph, buffers, tickets))
        return cap.handouts[-1]

    def _serve(self, cap: _Capture):
        """Replay cap's signature and return outputs the caller may keep: a free handout's buffers; else a new
        handout's, while the signature has fewer than HANDOUTS; else copies of the first graph's outputs."""
        for handout in cap.handouts[:self.HANDOUTS]:
            if handout.free():
                handout.graph.replay()
                return handout.outputs(type(cap.outputs))
        if len(cap.handouts) < self.HANDOUTS and cap.handouts_refused is None:
            if (handout := self._capture_handout(cap)) is not None:  # it replayed this call's inputs
                return handout.outputs(type(cap.outputs))
        cap.graph.replay()
        return type(cap.outputs)(o.clone() if isinstance(o, torch.Tensor) else o for o in cap.outputs)

    def __call__(self, inputs: list):
        args = tuple(inputs)
        inputs.clear()
        if not self._on_cuda(args):
            return self.fn(list(args))
        cap = self.last
        if cap is None or cap.graph is None or not cap.replays(args):
            ptrs = _ptrs(args)
            signature = _signature(args)
            cap = self.captures.pop(signature, None) or _Capture()
            self.captures[signature] = cap  # now the most recently used
            if len(self.captures) > self.MAX_SIGNATURES:
                del self.captures[next(iter(self.captures))]
            self.last = cap
            if cap.first_ptrs is None:
                cap.first_ptrs = ptrs
                return self.fn(list(args))
            if cap.refused:
                return self.fn(list(args))
            if cap.graph is None or cap.moved(ptrs):
                self._capture(cap, args, ptrs)  # its second call, or an input it reads in place moved
                if cap.refused:
                    return self.fn(list(args))
            else:
                cap.remember(args, ptrs)  # the same addresses, other objects: replays() compares these now
        for i in cap.copied:
            cap.static[i].copy_(args[i])
        if cap.folds is not None and not cap.folds.refresh():  # folded conv weights the graph reads in place
            self._capture(cap, args, _ptrs(args))  # a refold overflowed its dtype: that conv now runs unfolded
        if cap.refused:
            return self.fn(list(args))
        return self._serve(cap)


def wanted(cuda_graphs: bool | None, graph: str, example_inputs) -> bool:
    """Does this graph ("inference", "forward" or "backward") replay through CUDA graphs? Config.cuda_graphs
    decides, or when None (the default), inference graphs on CUDA do: their replays return outputs the caller
    owns, as eager's, where training's outputs would live in the graph's pool."""
    if cuda_graphs is not None:
        return cuda_graphs
    return graph == "inference" and on_cuda(example_inputs)


def refusal(gm: fx.GraphModule, graph: str) -> str | None:
    """The checks torch's own cudagraphs backend makes: one CUDA device and no CPU tensors, no op that cannot
    be captured (a host sync such as .item(), an op tagged cudagraph-unsafe), and no in-place write to an
    input that a replay would see only as its static copy."""
    from torch._dynamo.backends.cudagraphs import find_input_mutations, get_device_node_mapping
    from torch._inductor.cudagraph_utils import check_multiple_devices_or_any_cpu_nodes
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    if why := check_multiple_devices_or_any_cpu_nodes(get_device_node_mapping(gm)):
        return why.removeprefix("skipping cudagraphs due to ").split(". Found from")[0].splitlines()[0]
    if node := get_first_incompatible_cudagraph_node(gm):
        return f"{node.name} ({node.target}) cannot be captured"
    if mutated := sorted(find_input_mutations(gm.graph) - set(static_inputs(gm, graph))):
        return f"it writes in place to input(s) {mutated}, which a replay would write to a static copy"
    return None


def static_inputs(gm: fx.GraphModule, graph: str) -> list[int]:
    """Inputs at fixed addresses: a backward's saved activations (in the graph pool), else the parameters and
    buffers aot_autograd lifted."""
    from torch._inductor.compile_fx import get_static_input_idxs
    from torch._inductor.utils import count_tangents

    return list(range(count_tangents(gm))) if graph == "backward" else list(get_static_input_idxs(0))


def wrap(fn, gm: fx.GraphModule, example_inputs, graph: str, why_not: str | None, graphed: dict, report=None):
    """fn (boxed: gm built, eagerly or by Inductor) replayed as a CUDA graph where it can be. A backward goes
    under the graph trees only with its own forward (`graphed` is shared by the two); a refused backward of a
    graphed forward runs plainly, telling the tree manager that the backward has begun, as torch's cudagraphs
    backend does."""
    if graph == "inference":
        return fn if why_not else CudaGraphed(fn, report)
    if graph == "forward":
        graphed["forward"] = why_not is None
        return fn if why_not else graph_tree(fn, gm, example_inputs, graph)
    if not graphed.get("forward"):
        return fn
    if why_not is None:
        return graph_tree(fn, gm, example_inputs, graph)

    def backward(args: list):
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        if manager is not None:
            manager.set_to_running_backward()
        return fn(args)

    backward._boxed_call = True
    return backward


def graph_tree(fn, gm: fx.GraphModule, example_inputs, graph: str):  # fn: boxed (takes and empties a list)
    """Training's forward or backward graph (fn, built from gm) under torch's CUDA graph trees, the machinery of
    torch.compile's reduce-overhead mode: forward and backward share one memory pool, so the activations the
    forward saves are read in place by the backward; parameters are static inputs (re-recorded if they move); the
    first calls run eagerly (warm-up: our fused ops tune there). Only for graphs `refusal` accepts."""
    from torch._dynamo.backends.cudagraphs import find_input_mutations, get_stack_traces
    from torch._inductor.cudagraph_trees import cudagraphify_impl
    from torch._inductor.cudagraph_utils import get_placeholder_info

    device = next(t.device for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda)
    fn = cudagraphify_impl(
        fn, list(example_inputs), static_inputs(gm, graph),
        device_index=device.index, is_backward=graph == "backward", is_inference=False,
        stack_traces=get_stack_traces(gm), placeholders=get_placeholder_info(gm.graph),
        mutated_input_idxs=find_input_mutations(gm.graph))
    fn._boxed_call = True
    return fn
