"""Plans: what one launch of a fused kernel needs that depends only on shapes, strides, dtypes and the config,
computed once per key and reused (launch.py builds them, batch_norm*.py too).

Entry points: `Plan` (its `launch` fills in the tensors, each call), `Launcher` (a plan's launches of its kernel,
past the first without Triton's JIT), `launch` (the same for a call site without a plan), `plan_key`,
`cached_launch`, `launch_or_refuse` (a plan whose config may not load here), `operand_strides` (each operand's
[S, P, C] strides), `descriptor_operands` (the full operands a TMA family reads through tensor descriptors),
`operand_args` (an epilogue's kernel arguments, from those two), `pdl_meta` (programmatic dependent launch's
options), `prefetch_meta` (the weight prefetch's) and `sm_count`.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .. import epilogue as epi
from . import options, split_k, tiles


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another; split-K buys nothing there
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _pdl_supported(device: torch.device) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    from triton.backends.nvidia.compiler import CUDAOptions
    return tiles.gdc_wait is not None and "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


@functools.lru_cache(maxsize=None)
def _bulk_copies(device: torch.device) -> bool:
    """Can kernels on `device` read through tensor descriptors (TMA, Hopper and later; or the interpreter)?"""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_meta(device: torch.device) -> dict:
    """The launch options of a kernel's PDL switch (its first statement, tiles.dependent_launch): programmatic
    dependent launch on Hopper and later, when the option is on and the installed triton has it; else off."""
    on = options()["pdl"] and not options()["interpret"] and _pdl_supported(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def prefetch_meta(device: torch.device, programs: int) -> dict:
    """A generated kernel's PREFETCH switch (codegen.Family.prefetch: its weight tile asked of L2 first): on for a
    launch of at most one program an SM, whose time is its loop's latency (a conv at batch 1), on Hopper and later
    (bulk prefetches), when the option is on; never under the interpreter. On an H100 it took ResNet-50 bs1 from
    0.268-0.271 to 0.264-0.267 ms; asked on every launch, it cost BERT bs32 0.8%, whose GEMMs fill the GPU many
    times over."""
    on = (options()["prefetch"] and not options()["interpret"] and _bulk_prefetch(device)
          and programs <= sm_count(device))
    return {"PREFETCH": on}


@functools.lru_cache(maxsize=None)
def _bulk_prefetch(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


class Launcher:
    """`kernel[grid](*args, **meta)` for one plan's fixed grid and meta, where only the tensors change between calls.

    The first launch goes through Triton's JIT, which binds the arguments, specialises, compiles and launches. Later
    ones on the same device call the compiled kernel directly (its launcher, as `CompiledKernel[grid]` gives it),
    with the constexpr values appended as the JIT appends them: the JIT's binding and specialisation cost 84 us of
    host time a launch on the H100 machine's host, most of an un-graphed call's (bench/host_split.py). This is
    safe because a plan's key (`plan_key`) fixes what the JIT specialises on: every int argument (shapes, strides,
    the config), and each tensor's dtype and 16-byte alignment; the other tensors a launch passes (split-K's
    workspace, a statistics scratch) are fresh allocations, always aligned. Under the interpreter the JIT returns
    no compiled kernel, and every launch goes through it."""

    def __init__(self, kernel, grid: tuple, meta: dict):
        self.kernel, self.grid, self.meta = kernel, grid, meta
        self.direct, self.tail, self.device = None, (), None  # direct: False once found not to apply

    def __call__(self, *args) -> None:
        if self.direct and torch.cuda.current_device() == self.device:
            self.direct(*args, *self.tail)
            return
        compiled = self.kernel[self.grid](*args, **self.meta)
        if self.direct is None:
            self.direct = self._direct(compiled, len(args))

    def _direct(self, compiled, given: int):
        """The compiled kernel's launcher at this grid, and the constexpr values that follow the positional
        arguments in the kernel's parameter order; False where there is none (the interpreter)."""
        if not all(hasattr(compiled, a) for a in ("__getitem__", "function", "packed_metadata")):
            return False
        tail = []
        for param in self.kernel.params[given:]:
            if param.name not in self.meta and not param.has_default:
                return False
            tail.append(self.meta.get(param.name, param.default))
        self.tail, self.device = tuple(tail), torch.cuda.current_device()
        return compiled[(*self.grid, 1, 1)[:3]]  # the compiled launcher reads three grid dims, as the JIT gives it


_LAUNCHERS: dict = {}  # (kernel, grid, meta, argument signature) -> Launcher, for launch()


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """`kernel[grid](*args, **meta)` at a call site without a plan of its own (the batch norms', the pools'): a
    Launcher per kernel, grid, meta and argument signature, the part of the arguments the JIT specialises on (each
    tensor's dtype and 16-byte alignment, every int and bool; floats are passed as values), so that only the first
    launch of each goes through the JIT. An argument of another type (a tensor descriptor) takes the JIT."""
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, (int, float)) or a is None:  # bools are ints
            sig.append(None if type(a) is float else a)
        else:
            kernel[grid](*args, **meta)
            return
    key = (kernel, grid, tuple(meta.items()), tuple(sig))
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS[key] = Launcher(kernel, grid, meta)
    launcher(*args)


class Plan:
    """Everything about one launch that depends only on shapes, strides, dtypes and the config, computed once
    per such key (the host time per call was mostly this, ~100 us a fused op): the kernel, the grid, the
    scalar arguments and each operand's [S, P, C] strides. A call only fills in the tensors."""

    def __init__(self, kernel, grid, head: list, operand_strides: list, meta: dict, ws_shape: tuple,
                 device: torch.device, prepare=None, row_blocks: int = 0, operand_boxes: dict | None = None,
                 out_box: tuple | None = None, pdl: bool = True):
        self.grid, self.head, self.ws_shape = grid, head, ws_shape
        self.row_blocks = row_blocks  # the mainloop's row_block count (codegen.Family): a bn_stats root's partials
        self.meta = dict(meta, **(pdl_meta(device) if pdl else {"PDL": False}),
                         **prefetch_meta(device, grid[0] * grid[1] * grid[2]))
        self.kernel = Launcher(kernel, grid, self.meta)
        self.operand_strides = operand_strides  # None where the [S, P, C] view is not a view (a copy each call)
        self.prepare = prepare  # the inputs -> what the kernel takes for them (TMA descriptors), or None
        self.operand_boxes = operand_boxes or {}  # slot -> a descriptor's (shape, strides, box): descriptor_operands
        self.out_box = out_box  # the output's descriptor (shape, strides, box) where it is written by bulk stores

    def launch(self, tensors: tuple, out, operands, signature: str, out_shape, channel_dim: int, aux=None,
               stats=None):
        if self.prepare is not None:
            tensors = self.prepare(*tensors)
        ws, tickets = split_k.buffers(out, *self.ws_shape)
        op_args = operand_args(operands, self.operand_strides, self.operand_boxes, signature, out_shape, channel_dim)
        outs = (out,) if aux is None else (out, aux)  # the aux output is written through out's offsets
        if self.out_box is not None:
            from triton.tools.tensor_descriptor import TensorDescriptor
            outs = (TensorDescriptor(out, *self.out_box), *outs[1:])
        if stats is not None:
            partials = torch.empty((*stats.shape, self.row_blocks), dtype=torch.float32, device=out.device)
            outs += (partials, self.row_blocks)
        self.kernel(*outs, ws, tickets, *tensors, *self.head, *op_args)
        if stats is not None:
            torch.sum(partials, -1, out=stats)
        return out


def operand_args(operands, strides: list, boxes: dict, signature: str, out_shape, channel_dim: int) -> list:
    """The kernel arguments of an epilogue's operands (epilogue_source.triton_params): each a pointer, or a tensor
    descriptor for a slot in `boxes` (descriptor_operands), then its [S, P, C] strides (operand_strides; None: the
    view is not a view of the tensor, so a copy is made this call)."""
    args, views = [], None
    for i, (t, st) in enumerate(zip(operands, strides)):
        if st is None:
            views = views or epi.operand_views(epi.parse(signature), operands, out_shape, channel_dim)
            t, st = views[i], views[i].stride()
        elif i in boxes:
            from triton.tools.tensor_descriptor import TensorDescriptor
            t = TensorDescriptor(t, *boxes[i])
        args += [t, *st]
    return args


_PLANS: dict = {}


def launch_or_refuse(plans: dict, key, kernel: str, launch) -> None:
    """launch(plans[key]) for a plan cache whose entries may be refusals (a str, the reason): a config that does not
    load here (Triton raises as the kernel loads, before anything runs: an untuned config too large for this GPU's
    shared memory) leaves its reason in the plan's place, and NotImplementedError says it, now and on every later
    call. The chain's and the shortcut's plans; ops/chain.run_pair then runs the pair as two convs."""
    import triton

    plan = plans[key]
    if isinstance(plan, str):
        raise NotImplementedError(plan)
    try:
        launch(plan)
    except triton.runtime.errors.OutOfResources as e:
        plans[key] = f"the {kernel} kernel's config {plan.config} is out of resources here: {e}"
        raise NotImplementedError(plans[key]) from e


def cached_launch(key, build, tensors: tuple, out, operands, signature: str, channel_dim: int, aux=None,
                   stats=None):
    """Launch with the Plan for `key`, built on first sight (None: nothing to compute, e.g. an empty output)."""
    plan = _PLANS.get(key)
    if plan is None:
        check_outputs(signature, out, channel_dim, aux, stats)
        plan = _PLANS[key] = build()
    if plan is not None:
        plan.launch(tensors, out, operands, signature, out.shape, channel_dim, aux, stats)
    elif stats is not None:
        stats.zero_()  # the sums over no rows
    return out


def check_outputs(signature: str, out: torch.Tensor, channel_dim: int, aux: torch.Tensor | None,
                   stats: torch.Tensor | None) -> None:
    """An epilogue with an aux node writes a second output, shaped and strided like `out` (its dtype may differ:
    an fp32 output under a float32 marker keeps an fp16 aux); one with a bn_stats root, fp32 [2, C] sums."""
    tree = epi.parse(signature)
    wants = epi.aux_value(tree) is not None
    if wants != (aux is not None):
        raise ValueError(f"epilogue {signature} {'needs' if wants else 'has no'} aux output")
    if aux is not None and (aux.shape != out.shape or aux.stride() != out.stride() or aux.device != out.device):
        raise ValueError(f"aux output {tuple(aux.shape)} / {aux.stride()} is not laid out like the output "
                         f"{tuple(out.shape)} / {out.stride()}")
    wants = epi.stats_node(tree) is not None
    if wants != (stats is not None):
        raise ValueError(f"epilogue {signature} {'needs' if wants else 'has no'} statistics output")
    if stats is not None and (stats.shape != (2, out.shape[channel_dim]) or stats.dtype != torch.float32
                              or not stats.is_contiguous() or stats.device != out.device):
        raise ValueError(f"statistics output {tuple(stats.shape)} {stats.dtype} is not a contiguous fp32 "
                         f"[2, {out.shape[channel_dim]}] on {out.device}")


def plan_key(*parts) -> tuple:
    """A Plan's cache key: the tensors' shapes, strides, dtypes, devices and whether their base is 16-byte
    aligned (what a tensor descriptor needs), the other parts as they are."""
    key = tuple((p.shape, p.stride(), p.dtype, p.device, p.data_ptr() % 16 == 0) if isinstance(p, torch.Tensor)
                else p for p in parts)
    return (*key, options()["pdl"], options()["prefetch"], options()["tma_store"])


def descriptor_operands(signature: str, operands, out_shape, channel_dim: int, m: int, n: int, box: list) -> dict:
    """{slot: (shape, strides, box)}: the full operands a TMA family (codegen.Family.origin) reads through tensor
    descriptors. Each must be an fp16/bf16 [M, N] matrix whose rows are the output's rows (the [S, P, C] view
    with samples and rows merged), its rows contiguous, base and row stride 16-byte aligned; the others keep
    their pointer loads. (fp32 operands keep them too: a fp32 box doubles the epilogue's shared memory.)"""
    tree = epi.parse(signature)
    found = {}
    if not operands or max(box) > 256 or not _bulk_copies(operands[0].device):
        return found  # a descriptor's box spans at most 256 elements a dim; TMA needs Hopper or later
    for o, t, v in zip(epi.operands(tree), operands, epi.operand_views(tree, operands, out_shape, channel_dim)):
        if o.kind != "full" or v.data_ptr() != t.data_ptr() or v.dtype not in (torch.float16, torch.bfloat16):
            continue
        (s, p, c), (s_s, s_p, s_c) = v.shape, v.stride()
        row = s_p if p > 1 else s_s if s > 1 else c
        merged = s == 1 or p == 1 or s_s == p * s_p
        if (s * p, c) != (m, n) or s_c != 1 or not merged or row * 2 % 16 or v.data_ptr() % 16:
            continue
        found[o.slot] = ([m, n], [row, 1], box)
    return found


def descriptor_output(out: torch.Tensor, m: int, n: int, row_stride: int, box: list, smem: int) -> tuple | None:
    """The (shape, strides, box) of `out` as the [M, N] matrix of rows `row_stride` apart that a TMA family
    (codegen.Family.origin) writes by bulk stores for a config with tma_store, or None, for per-thread stores:
    where the option is off (resfuse.Config.tma_store), the output is not fp16/bf16
    (an fp32 box doubles the store's shared memory), its base or rows are not 16-byte aligned, or the kernel's
    other shared memory (`smem` bytes: the mainloop's stages, the operands' boxes) leaves no room for the box."""
    if (not options()["tma_store"] or out.dtype not in (torch.float16, torch.bfloat16) or max(box) > 256
            or not _bulk_copies(out.device) or out.data_ptr() % 16 or row_stride * out.element_size() % 16
            or smem + box[0] * box[1] * out.element_size() > 220 * 1024):
        return None
    return [m, n], [row_stride, 1], box


def operand_strides(signature: str, operands, out_shape, channel_dim: int) -> list:
    views = epi.operand_views(epi.parse(signature), operands, out_shape, channel_dim)
    return [v.stride() if v.data_ptr() == t.data_ptr() else None for v, t in zip(views, operands)]
