"""The tuner's Triton kernels compiled, and its cuDNN engine configs built, in worker processes, ahead of their
first use.

Entry points: `ahead(gm)`, which the backend calls once a graph is rewritten, before its first run: every fused
op of the graph that will be tuned (conv, GEMM, conv data gradient, their aux and statistics forms, a chain of two
1x1 convs and its two convs) has its candidates' kernels and engine configs queued for the workers at once;
`precompile(fns)`, which choose.compile_in_parallel calls before it launches each candidate once: it waits for
those kernels (queuing any not queued yet); `cudnn_built(call, level)`, which choose.tune calls before it times
the candidates: the same for the call's cuDNN engine configs. The worker processes are workers.py's.

Why: a cold tuning is mostly compiles. MobileNetV3 bs32 on an H100 host (16 cores) compiled 759 Triton kernels in
134 of its 215 s first call. On compile_in_parallel's threads a compile took 1.44 s of wall time, of which 0.48 s
ran on its own thread; the rest waited on the GIL or on ptxas. ResNet-50 bs32 then spent 33 of its 89 s building
cuDNN's engine configs, one at a time: on threads they do not overlap (bench/tune_profile.py,
bench/cudnn_build_threads.py, BENCHMARKS.md).

How:
- `precompile` runs each callable once with Triton's `jit_cache_hook` set. The hook records what each launch
  would compile (the @jit function's module, its specialisation and options) and declines the compile, so the
  dry run neither compiles nor launches anything.
- The records go to a pool of worker processes started with `sys.executable -m` (never the user's script, which
  multiprocessing's spawn would re-import). Each worker calls `triton.compile` for the parent's GPU target,
  without a GPU context. Triton's on-disk cache (TRITON_CACHE_DIR, inherited) then holds every kernel.
- The callables' real first runs, on compile_in_parallel's threads, find their kernels there.
- A cuDNN job describes a call's graph by shapes, strides and dtypes (providers/cudnn.build_spec), one job an
  engine config. A pool of at most workers.CUDNN_WORKERS workers, each with a GPU context, builds them on meta
  tensors (cudnn.build_engine); the runtime-compiled kernels land in the CUDA driver's JIT cache on disk
  (CUDA_CACHE_PATH, inherited), where the tuning process's own build of the same engine config finds them.
- Queued ahead for a whole graph, the workers compile the later ops' kernels while the tuner measures the first
  ones: an op no longer waits for the slowest of its own ~16 compiles after the previous op's measurement.
- Anything a worker cannot rebuild (a kernel defined in a function, an unpicklable argument, a dead worker) is
  compiled in the tuning process as before: a cache miss costs time, never a wrong kernel.
- A worker without work for its pool's idle_s exits, so a tuned model holds neither its memory nor its GPU
  context. A cuDNN worker exits after 15 s: `ahead` queues a graph's engine configs all at once, so once they are
  built the pool has nothing left to do for that graph, and its 0.7 GB of GPU memory a worker (an H100) go back.

Switch: `Config.compile_workers` (env RESFUSE_COMPILE_WORKERS; 0 keeps compiling in the tuning process only).
"""
from __future__ import annotations

import concurrent.futures
import inspect
import json
import os
import pickle
import sys

from . import workers

WAIT_S = 300.0  # how long an op waits for its kernels' compiles (one took 1-3 s on an H100 host)


def precompile(fns) -> int:
    """Compile in worker processes every Triton kernel the callables would launch (those queued already by
    `ahead` are waited for); returns how many compiled."""
    if workers.wanted() == 0 or workers.POOLS["triton"]["broken"]:
        return 0
    futures = workers.submit(record(fns))
    done, _ = concurrent.futures.wait(futures, timeout=WAIT_S)  # past it, the threads compile what is missing
    return sum(bool(f.result()) for f in done)


def ahead(gm) -> int:
    """Queue the candidates' kernels and engine configs of every fused op in `gm` that the tuner will measure,
    without waiting; returns how many Triton kernels were queued that were not queued before. Each op's calls are
    built from the graph's shapes on scratch tensors, one op at a time (freed before the next). Ops with a dynamic
    dim are left to `precompile` and `cudnn_built`."""
    from .choose import _off_thread, level_now

    devices = {v.device for n in gm.graph.nodes if (v := n.meta.get("val")) is not None
               and getattr(v, "device", None) is not None and v.device.type == "cuda"}
    if workers.wanted() == 0 or workers.POOLS["triton"]["broken"] or not devices or level_now() == "none":
        return 0
    device = min(devices, key=str)
    queued = _off_thread(device, _queue_graph, gm)  # its scratch off the caller's thread, as tuning's
    import torch

    torch.cuda.empty_cache()  # and not left reserved, where a CUDA graph's private pool would never reuse it
    return queued


def _queue_graph(gm) -> int:
    from .. import providers
    from .choose import allowed, fast_key, level_now, needs_tuning, triton_launches

    seen = set()

    def wanted(call) -> bool:  # on the graph's fake tensors: a warm start allocates nothing
        problem = fast_key(call)  # a repeated block's ops: one problem, tuned once
        if problem in seen or not needs_tuning(call):
            return False
        seen.add(problem)
        return True

    before = len(workers.QUEUED)
    for call in _calls(gm, wanted):  # refusals on the scratch tensors: the chain kernel's asks their addresses
        workers.submit(record(triton_launches(providers.candidates(call, level_now(),
                                                                   allowed(call, ("triton", "epilogue"))))))
        _queue_cudnn(call, level_now())
    return len(workers.QUEUED) - before  # distinct kernels: problems share some (MobileNetV3 bs32: 730 for 989 futures)


def cudnn_built(call, level: str) -> None:
    """Before the tuner times the cudnn provider's candidates for `call`: its engine configs built by the workers
    (queued now unless `ahead` queued them), so that the candidates' own builds load the kernels from the CUDA
    driver's JIT cache. A cold ResNet-50 bs32 tuning spent 33 of its 89 s building them one by one in the tuning
    process; on threads they did not overlap (bench/cudnn_build_threads.py: 52 s on 1 thread, 62 on 8). A second
    process found them in the driver's cache (CUDA_CACHE_PATH) in 3 s."""
    concurrent.futures.wait(_queue_cudnn(call, level), timeout=WAIT_S)


def _queue_cudnn(call, level: str) -> list:
    """The futures of the workers' builds of each engine config the level times for `call`, a job each; none where
    cuDNN's candidates are not measured (Config.providers), or where the CUDA driver keeps no JIT cache
    (CUDA_CACHE_DISABLE=1): a worker's build would not reach the tuner."""
    from .. import providers
    from .choose import allowed, fast_key

    if "cudnn" not in allowed(call) or os.environ.get("CUDA_CACHE_DISABLE") == "1":
        return []
    spec = providers.cudnn.build_spec(call, level)
    if spec is None:
        return []
    problem = fast_key(call)
    return workers.submit([dict(spec, index=i) for i in range(spec["engines"])], "cudnn",
                          lambda s: ("cudnn", problem, s["index"]))


FUSED_OPS = ("conv2d", "conv2d_aux", "gemm", "gemm_aux", "conv2d_dgrad", "conv2d_dgrad_stats", "conv2d_chain",
             "conv2d_shortcut")


def _calls(gm, wanted=lambda call: True, device_type: str = "cuda"):
    """The tuner's Calls of each fused op node of `gm` that runs our kernels (provider "triton"), with static
    shapes on `device_type`, on scratch tensors, where `wanted` accepts the same call on the graph's fake tensors.
    A chain or a shortcut op gives three, in the order it tunes them: its first conv, its second, then itself."""
    import torch

    from ..passes import legality

    ops = {getattr(torch.ops.resfuse, name).default: name for name in FUSED_OPS}
    for node in gm.graph.nodes:
        name = ops.get(node.target) if node.op == "call_function" else None
        if name is None or node.args[-1] != "triton":
            continue
        out = node.meta.get("val")
        vals = [legality.val(n) for a in node.args for n in (a if isinstance(a, (list, tuple)) else [a])
                if isinstance(n, torch.fx.Node)]
        vals += list(out) if isinstance(out, (list, tuple)) else [out]
        if any(not isinstance(v, torch.Tensor) or v.device.type != device_type
               or not all(isinstance(d, int) for d in (*v.shape, *v.stride(), v.storage_offset())) for v in vals):
            continue
        picks = [i for i, call in enumerate(_node_calls(name, node.args, out, lambda v: v)) if wanted(call)]
        if picks:
            made = {}  # one scratch tensor a value, shared by a chain's three calls
            calls = _node_calls(name, node.args, out, lambda v: made.setdefault(id(v), _scratch(v)))
            yield from (calls[i] for i in picks)


def _node_calls(name: str, args: tuple, out, tensor) -> list:
    """The Calls the op `name` builds when it first runs (ops/fused.py, ops/training.py, ops/chain.py,
    ops/shortcut.py), with each of its node's values v (the arguments' and the outputs') as tensor(v)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    from ..ops import chain, fused, shortcut, training
    from ..passes import legality
    from .choose import Call

    def arg(n):
        return tensor(legality.val(n))

    if name == "conv2d_chain":
        x, w1, operands1, epilogue1, w2, operands2, epilogue2, _ = args
        x, w1, w2, operands1, operands2 = arg(x), arg(w1), arg(w2), [*map(arg, operands1)], [*map(arg, operands2)]
        return [fused.call_of("conv2d", (x, w1), operands1, epilogue1, chain.ONE),
                fused.call_of("conv2d", (tensor(out[0]), w2), operands2, epilogue2, chain.ONE),
                chain.call_of(x, w1, operands1, epilogue1, w2, operands2, epilogue2)]
    if name == "conv2d_shortcut":
        y, w1, operands1, epilogue1, slot, x, w2, operands2, epilogue2, stride, _ = args
        y, w1, x, w2, operands1, operands2 = (arg(y), arg(w1), arg(x), arg(w2), [*map(arg, operands1)],
                                              [*map(arg, operands2)])
        r = fused.conv_output(x, w2, epilogue2, stride, *shortcut.UNPADDED)  # no graph value: the op never writes it
        r = torch.empty_strided(r.shape, r.strides, dtype=r.dtype, device="meta" if isinstance(x, FakeTensor)
                                else r.device)
        return [fused.call_of("conv2d", (x, w2), operands2, epilogue2, (stride, *shortcut.UNPADDED)),
                fused.call_of("conv2d", (y, w1), [*operands1[:slot], r, *operands1[slot:]], epilogue1, chain.ONE),
                shortcut.call_of(y, w1, operands1, epilogue1, slot, x, w2, operands2, epilogue2, stride)]
    inputs, operands, epilogue, params = (arg(args[0]), arg(args[1])), [*map(arg, args[2])], args[3], tuple(args[4:-1])
    second = tensor(out[1]) if name.endswith(("_aux", "_stats")) else None  # the aux output, or the [2, C] sums
    if name.startswith("conv2d_dgrad"):
        input_shape, stride, padding, dilation = params
        return [Call("conv2d_dgrad", inputs, operands, epilogue, (list(stride), list(padding), list(dilation)),
                     training.dgrad_out(*inputs, input_shape), stats=second)]
    return [fused.call_of(name.removesuffix("_aux"), inputs, operands, epilogue, params, aux=second)]


def _scratch(v):
    """An uninitialised tensor laid out as `v`, at its storage offset: Triton specialises a pointer on its
    alignment, so a view's kernel is not the one of a tensor at its storage's start."""
    import torch

    span = 1 + sum((n - 1) * s for n, s in zip(v.shape, v.stride())) if v.numel() else 0
    base = torch.empty(v.storage_offset() + span, dtype=v.dtype, device=v.device)
    return base.as_strided(v.shape, v.stride(), v.storage_offset())


def record(fns) -> list[dict]:
    """What each callable's launches would compile, one spec per distinct kernel; nothing compiles or runs."""
    import triton
    from triton.runtime import driver

    if not hasattr(triton, "knobs"):  # triton < 3.4: no jit_cache_hook to record with
        return []
    try:
        target = driver.active.get_current_target()
    except RuntimeError:  # no GPU driver
        return []
    found = {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        spec = _spec(fn.jit_function, compile)
        if spec is not None:
            found.setdefault(compile["specialization_data"], spec)
        return True  # declined: jit.run returns without compiling or launching

    knobs = triton.knobs.runtime
    previous, knobs.jit_cache_hook = knobs.jit_cache_hook, hook
    try:
        for fn in fns:
            try:
                fn()
            except Exception:  # noqa: BLE001  the real run meets the same error and reports it
                pass
    finally:
        knobs.jit_cache_hook = previous
    return [dict(spec, target=target) for spec in found.values()]


def _spec(jit, compile: dict) -> dict | None:
    """The picklable description of one compile: where the @jit function lives and how it is specialised."""
    fn = jit.fn
    name, module = fn.__name__, sys.modules.get(fn.__module__)
    if module is None or getattr(module, name, None) is not jit:
        return None  # not a module-level kernel: a worker could not find it
    data = json.loads(compile["specialization_data"])
    spec = {"module": fn.__module__, "path": inspect.getsourcefile(fn), "name": name,
            "signature": compile["signature"], "constants": compile["constants"], "attrs": compile["configs"][0],
            "options": _tuples(data["options"]), "specialization": compile["specialization_data"]}
    try:
        pickle.dumps(spec)
    except Exception:  # noqa: BLE001  e.g. a constexpr of a type pickle does not know
        return None
    return spec


def _tuples(value):
    """JSON's lists back to the tuples Triton's options hold (its cache key hashes them)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value
