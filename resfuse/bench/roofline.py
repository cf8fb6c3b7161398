"""The per-layer roofline floor: how fast a fully fused model could run on this device, at best.

Entry points: `measure_ceilings(device) -> (matmul_flops_per_s, copy_bytes_per_s)` and
`floor(model, inputs, ceilings) -> (seconds, layers)`. run.py calls both once per benchmark, next to the
timings, so every latency can be read as "x times the floor".

floor = sum over layers of max(FLOPs / matmul peak, minimal bytes / copy bandwidth).

How layers are found. One eager forward runs under a TorchDispatchMode that sees every ATen op (as
`torch.utils.flop_counter.FlopCounterMode` does, whose per-op FLOP formulas we reuse) and follows each
tensor from the op that produced it to the ops that read it. Ops are then grouped as a fully fusing
compiler would group them:
- an anchor (convolution, mm/addmm/bmm/baddbmm, scaled-dot-product attention: the ops FlopCounterMode
  counts) starts a compute layer; a whole `F.scaled_dot_product_attention` call is one anchor (seen
  through a TorchFunctionMode), so a decomposed math path is charged like a fused flash kernel: Q, K, V
  (and a mask) read, the output written, the attention matrix never stored;
- an elementwise op (ATen's `pointwise` tag, batch norm in inference, dtype/layout copies) joins the
  layer that produced its most recently produced input: it is the anchor's epilogue, including a
  residual add (add-to-output), whose other operand becomes one more input of that layer;
- views cost nothing: they alias their input (a slice aliases a fraction of it);
- any other op (pooling, softmax, layer norm, embedding, reductions, cat) is a memory-only layer, whose
  own elementwise consumers join it as well.

Minimal bytes of a layer = every tensor it reads from outside the layer, counted once (activations,
weights, bias, BN vectors, the residual), plus every tensor it produces that something outside the layer
(or the model's caller) reads, written once. Tensors that live and die inside a layer cost nothing: the
assumption is that the epilogue runs on the accumulator in registers. Embedding reads only the rows it
gathers. All anchors share one FLOP ceiling, the measured dense fp16 (or the run's dtype) matmul rate,
which overstates what a depthwise or grouped conv can reach: the floor is a bound, not a prediction.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten

# Inference batch norm is a per-channel scale and shift: an epilogue, though ATen does not tag it pointwise.
_EPILOGUE_OPS = {aten._native_batch_norm_legit_no_training, aten.native_batch_norm,
                 aten.cudnn_batch_norm, aten._to_copy, aten.copy_, aten.clone}
# Ops that return a tensor sharing the input's memory without being schema views.
_ALIAS_OPS = {aten._unsafe_view, aten.alias, aten.detach, aten.lift_fresh}
# Gathers read the rows they return, not the whole table.
_GATHER_OPS = {aten.embedding}


def _sdpa_cpu_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    # FlopCounterMode has no formula for the CPU flash kernel: Q @ K^T then P @ V, 2 FLOPs per MAC.
    b, h, lq, d = query.shape
    lk, dv = key.shape[-2], value.shape[-1]
    return 2 * b * h * lq * lk * (d + dv)


def _grouped_query(formula):
    """An attention op's FLOP formula that also takes grouped-query attention (Llama's: fewer key/value heads than
    query heads, each serving a group of them); torch 2.11's formulas refuse the shapes. They read shapes alone,
    so the key and value are given as meta tensors with the query's heads."""
    def flops(query, key, value, *args, **kwargs):
        heads = query.shape[1]
        if key.dim() == 4 and key.shape[1] != heads:
            key, value = (torch.empty((t.shape[0], heads, *t.shape[2:]), dtype=t.dtype, device="meta")
                          for t in (key, value))
        return formula(query, key, value, *args, **kwargs)
    return flops


_FLOPS = {**flop_registry, aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops}
_FLOPS.update({packet: _grouped_query(f) for packet, f in _FLOPS.items()
               if "scaled_dot_product" in str(packet) and "backward" not in str(packet)})


@dataclasses.dataclass
class Layer:
    name: str
    kind: str  # "compute" (has an anchor) or "memory"
    flops: int = 0
    bytes: int = 0
    compute_s: float = 0.0
    memory_s: float = 0.0
    floor_s: float = 0.0
    ops: list[str] = dataclasses.field(default_factory=list)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


@dataclasses.dataclass
class _Group:
    layer: Layer
    reads: dict[int, int] = dataclasses.field(default_factory=dict)  # value id -> bytes, read from outside


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Tracer(TorchDispatchMode):
    """Record each op's group, the values it reads and the values it produces."""

    def __init__(self):
        super().__init__()
        self.value = WeakIdKeyDictionary()  # tensor -> value id (in-place ops give the tensor a new one)
        self.size: dict[int, int] = {}  # value id -> bytes
        self.producer: dict[int, int] = {}  # value id -> group index; absent for inputs and weights
        self.readers: dict[int, set[int]] = defaultdict(set)  # value id -> groups reading it
        self.groups: list[_Group] = []
        self.region: int | None = None  # a group that every op joins while an attention call runs

    def _new_value(self, t: torch.Tensor, group: int | None, nbytes: int | None = None) -> int:
        vid = len(self.size)
        self.size[vid] = _nbytes(t) if nbytes is None else nbytes
        if group is not None:
            self.producer[vid] = group
        self.value[t] = vid
        return vid

    def _value_of(self, t: torch.Tensor) -> int:
        vid = self.value.get(t)
        return self._new_value(t, None) if vid is None else vid

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        packet = func.overloadpacket
        if func.is_view or packet in _ALIAS_OPS:
            self._alias(ins[0], outs)
            return out
        in_values = [self._value_of(t) for t in ins]
        group = self._group_for(func, packet, in_values, args, kwargs, out)
        g = self.groups[group]
        g.layer.ops.append(str(packet).removeprefix("aten."))
        gather = packet in _GATHER_OPS
        for t, vid in zip(ins, in_values):
            if self.producer.get(vid) != group:
                self.readers[vid].add(group)
                if gather and t is args[0]:
                    g.reads[vid] = sum(_nbytes(o) for o in outs)
                else:
                    g.reads[vid] = self.size[vid]
        for t in outs:
            self._new_value(t, group)  # in-place ops land here too: the mutated tensor is a new value
        return out

    def _alias(self, base: torch.Tensor, outs: list[torch.Tensor]) -> None:
        base_vid = self._value_of(base)
        for t in outs:
            if _nbytes(t) >= self.size[base_vid] or t.numel() == base.numel():
                self.value[t] = base_vid  # the whole tensor (or a broadcast of it): same bytes
            else:
                # A slice: reading it costs its own bytes; whoever produced the base wrote it.
                self._new_value(t, self.producer.get(base_vid), nbytes=_nbytes(t))

    def _group_for(self, func, packet, in_values, args, kwargs, out) -> int:
        if self.region is not None:
            self.groups[self.region].layer.flops += int(_FLOPS[packet](*args, **kwargs, out_val=out)) \
                if packet in _FLOPS else 0
            return self.region
        if packet in _FLOPS:
            flops = int(_FLOPS[packet](*args, **kwargs, out_val=out))
            return self._open(Layer(_describe(packet, out), "compute", flops=flops))
        if torch.Tag.pointwise in func.tags or packet in _EPILOGUE_OPS:
            produced = [self.producer[v] for v in in_values if v in self.producer]
            if produced:
                return max(produced)  # the latest producer: the anchor whose epilogue this is
        return self._open(Layer(_describe(packet, out), "memory"))

    def _open(self, layer: Layer) -> int:
        self.groups.append(_Group(layer))
        return len(self.groups) - 1

    def finish(self, outputs) -> list[Layer]:
        external = -1  # the model's caller reads the outputs
        for t in tree_leaves(outputs):
            if isinstance(t, torch.Tensor):
                self.readers[self._value_of(t)].add(external)
        layers = []
        for index, g in enumerate(self.groups):
            written = sum(self.size[v] for v, p in self.producer.items()
                          if p == index and self.readers[v] - {index})
            g.layer.bytes = sum(g.reads.values()) + written
            if g.layer.flops or g.layer.bytes:  # drop empty() scratch that nothing reads
                layers.append(g.layer)
        return layers


def _describe(packet, out) -> str:
    shapes = [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    shape = "x".join(map(str, shapes[0])) if shapes else ""
    return f"{str(packet).removeprefix('aten.')} -> {shape}"


class _Attention(TorchFunctionMode):
    """Make each scaled_dot_product_attention call one layer, whatever kernel runs it.

    It is a composite op: on some devices and dtypes it decomposes into bmm, softmax, bmm, which would
    charge the floor for an attention matrix that a fused (flash) kernel never writes to memory."""

    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.tracer.region is not None:
            return func(*args, **kwargs)
        tracer = self.tracer
        tracer.region = tracer._open(Layer("scaled_dot_product_attention", "compute"))
        try:
            out = func(*args, **kwargs)
        finally:
            layer, tracer.region = tracer.groups[tracer.region].layer, None
        layer.name = _describe("scaled_dot_product_attention", out)
        return out


def trace_layers(model: torch.nn.Module, inputs: tuple) -> list[Layer]:
    """Group one forward's ATen ops into layers with FLOPs and minimal bytes (no timing)."""
    tracer = _Tracer()
    with torch.no_grad(), _Attention(tracer), tracer:
        out = model(*inputs)
    return tracer.finish(out)


def floor(model: torch.nn.Module, inputs: tuple,
          ceilings: tuple[float, float]) -> tuple[float, list[Layer]]:
    """Seconds a fully fused forward needs at best on a device with these ceilings, and the layers."""
    flops_per_s, bytes_per_s = ceilings
    layers = trace_layers(model, inputs)
    for layer in layers:
        layer.compute_s = layer.flops / flops_per_s
        layer.memory_s = layer.bytes / bytes_per_s
        layer.floor_s = max(layer.compute_s, layer.memory_s)
    return sum(layer.floor_s for layer in layers), layers


def measure_ceilings(device: str | torch.device, dtype: torch.dtype | None = None,
                     repeats: int = 10) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) measured here: a large matmul in `dtype` (fp16 on CUDA, fp32 on CPU
    by default) and a large tensor copy counting bytes read plus bytes written. Medians of `repeats`."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype or (torch.float16 if cuda else torch.float32)
    n = 8192 if cuda else 1024
    operands = [torch.randn(n, n, device=device, dtype=dtype) for _ in range(2)]
    mm_s = _median_seconds(lambda: torch.mm(*operands), device, repeats)
    operands.clear()  # freed before the copy's 2 GiB are allocated
    elements = (1 << 28) if cuda else (1 << 24)  # 1 GiB / 64 MiB of fp32, far past any cache
    src = torch.randn(elements, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * n ** 3 / mm_s, 2 * _nbytes(src) / copy_s


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    for _ in range(2):
        fn()  # warm-up: library handles, allocator, clocks
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
