"""Which provider and config runs a fused op: remembered, or measured on first sight of a shape.

Entry points: `choose(call) -> Choice`, called by the custom ops on every CUDA call (a dict hit after the
first); `settled(call)`, the same where that needs no measurement (ops/chain.py runs the two convs of a chain
first, which tunes each on its own, before its own choice is measured); `configure(level, cache_dir, budget_s,
force)`, called by resfuse.compile; `tune(call, bench=...)`, the measurement itself (tests inject the
benchmarker).

Order of lookup: this process's choices, then the SQLite cache (tuning/cache.py), then tuning with the
two-stage selection (select.py) over the providers' candidates, stored unless the budget ran out (an op
with no candidate that matches the reference runs the unfused ATen path, remembered in-process). With
level "none", or on CPU (interpreter timings mean nothing), the heuristic Triton config runs (or, where our
kernels refuse the op, a grouped conv, cuDNN + our epilogue kernel); once a
compile's wall-clock budget is spent, the cuDNN/cuBLAS anchor with our epilogue kernel runs (UNTUNED). In
both cases nothing is stored.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import json
import os
import time
from pathlib import Path

import torch

from .. import epilogue as epi, providers
from ..config import PROVIDERS as ALL_PROVIDERS  # whose candidates a tuning may measure (Config.providers)
from ..kernels import codegen
from ..ops.fused import Output
from . import precompile, select, space
from .cache import Entry, Key, TuningCache, environment, machine
from .progress import PROGRESS

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 2e-3}  # fp32 runs as tf32


@dataclasses.dataclass
class Call:
    """One invocation of a fused op, as the providers need it."""
    op: str  # "conv2d" | "gemm" | "conv2d_dgrad" | "conv2d_chain" | "conv2d_shortcut" (ops/chain.py,
    #          ops/shortcut.py: both epilogues in `signature`)
    inputs: tuple  # (x, w), (a, b), (grad_out, w), a chain's (x, w1, w2) or a shortcut's (y, w1, x, w2)
    operands: list
    signature: str
    params: tuple  # conv2d and conv2d_dgrad: (stride, padding, dilation); gemm: (out_shape,); chain: (operands1,);
    #                shortcut: (operands1, the residual's slot, the shortcut's stride)
    out: Output  # described, not allocated: each provider allocates its own (candidates: scratch, never live data)
    aux: torch.Tensor | None = None  # the op's aux output, for an epilogue with an aux node (candidates: scratch)
    stats: torch.Tensor | None = None  # the op's [2, C] sums, for an epilogue with a bn_stats root (likewise)

    @functools.cached_property
    def problem(self) -> tuple:
        """The call's op, signature, parameters, output and tensor layouts, computed on first use and kept:
        fast_key asks on every call, more than once on the cuDNN provider's path (8.6 us each on the CI CPU). A
        Call's fields are not changed after it is made (dataclasses.replace makes a new one)."""
        return (self.op, self.signature, str(self.params), self.out,
                *[(t.shape, t.stride(), t.dtype) for t in (*self.inputs, *self.operands)])

    def scratch(self) -> "Call":
        """This call writing scratch aux and stats outputs instead of the op's own."""
        def own(t):
            return None if t is None else torch.empty_like(t)
        return self if self.aux is None and self.stats is None else dataclasses.replace(
            self, aux=own(self.aux), stats=own(self.stats))


@dataclasses.dataclass(frozen=True)
class Choice:
    provider: str  # "triton" | "epilogue" | "cudnn" | "aten"; a pair: "triton" | "separate" (any other: separate)
    config: object | None  # triton: a kernel config (None: the heuristic default); cudnn: {"engine", "fold_bn"} or None


HEURISTIC = Choice("triton", None)
UNTUNED = Choice("epilogue", None)  # cuDNN/cuBLAS + our epilogue kernel: no config to guess, never worse than ATen's
#                                     unfused ops in traffic; what runs once a compile's tuning budget is spent
UNFUSED = Choice("aten", None)
_SETTINGS = {"level": "fast", "cache_dir": None, "budget_s": 120.0, "force": False, "providers": ALL_PROVIDERS}
_STATE = {"spent_s": 0.0, "cache": None}
_CHOICES: dict[str, Choice] = {}


def configure(level: str, cache_dir: str, budget_s: float, force: bool = False, new_compile: bool = True,
              providers: tuple[str, ...] = ALL_PROVIDERS) -> None:
    """Settings for the ops that run from now on. A new compile gets the whole wall-clock budget again, and forgets
    the ops it ran untuned for want of budget, and (another cache, or a forced re-tune) the choices made so far. A
    compiled model's graphs switching back to their own settings (capture/backend.Settings: new_compile=False) keep
    all of that, so that two models called in turn neither tune again nor reset each other's budget. Choices under
    other `providers` are apart already: fast_key holds them."""
    if new_compile:
        _STATE["spent_s"] = 0.0
        for k in [k for k, c in _CHOICES.items() if c == UNTUNED]:
            del _CHOICES[k]
        if cache_dir != _SETTINGS["cache_dir"]:
            _CHOICES.clear()  # another cache: the choices read from or tuned into the last one are not its own
        if force and not _SETTINGS["force"]:
            _CHOICES.clear()  # a forced re-tune measures again what this process already chose
    if cache_dir != _SETTINGS["cache_dir"]:
        _STATE["cache"] = None
    _SETTINGS.update(level=level, cache_dir=cache_dir, budget_s=budget_s, force=force, providers=tuple(providers))


def _cache() -> TuningCache:
    if _STATE["cache"] is None:
        _STATE["cache"] = TuningCache(Path(_SETTINGS["cache_dir"]) / "tuning.sqlite")
    return _STATE["cache"]


def key(call: Call) -> Key:
    tensors, out = [*call.inputs, *call.operands], call.out
    versions = f"{codegen.TEMPLATE_VERSION}{epi.op_versions(call.signature)}"
    if set(_SETTINGS["providers"]) != set(ALL_PROVIDERS):  # a subset's winners are its own, not the default's
        versions += "|" + ",".join(sorted(_SETTINGS["providers"]))
    gpu, sms, versions = environment(out.device, versions)
    flat = tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in call.params)
    return Key(call.op, (*[tuple(t.shape) for t in call.inputs], flat),
               (*[str(t.dtype) for t in tensors], str(out.dtype)),
               (*[tuple(t.stride()) for t in tensors], tuple(out.strides)), call.signature, gpu, sms, versions)


def level_now() -> str:
    return _SETTINGS["level"]


def allowed(call: Call, among: tuple[str, ...] = ALL_PROVIDERS) -> tuple[str, ...]:
    """The providers of `among` whose candidates may be measured for `call` (Config.providers); a pair of convs
    also as its two convs ("separate"), each of which is tuned under the same rule."""
    pair = ("separate",) if call.op in providers.separate.PAIRS and "separate" in among else ()
    return (*[p for p in among if p in _SETTINGS["providers"]], *pair)


def needs_tuning(call: Call) -> bool:
    """Would choose(call) measure it now: tuning on, on CUDA, decided neither in this process nor in the cache."""
    if _SETTINGS["level"] == "none" or not _tunable(call.out.device) or fast_key(call) in _CHOICES:
        return False
    return _SETTINGS["force"] or _cache().get(key(call)) is None


def settled(call: Call) -> Choice | None:
    """choose(call) where that needs no measurement now; None where it would tune (first sight of the shapes)."""
    if _SETTINGS["level"] == "none" or not _tunable(call.out.device):
        return choose(call)
    return _CHOICES.get(fast_key(call))


def choose(call: Call) -> Choice:
    level = _SETTINGS["level"]
    if _OUT_OF_RESOURCES and fast_key(call) in _OUT_OF_RESOURCES:
        return UNTUNED  # our kernel's config did not load here (out_of_resources)
    if level == "none" or not _tunable(call.out.device):
        # our kernel's heuristic config, where our kernel takes the op (a grouped conv it refuses)
        return HEURISTIC if providers.triton.refusal(call) is None else UNTUNED
    fast = fast_key(call)  # every call passes here: no hashing, no device queries
    if fast in _CHOICES:
        return _CHOICES[fast]
    k = key(call)
    here = machine(call.out.device)
    entry, checked = (None, False) if _SETTINGS["force"] else _cache().lookup(k, here)
    replace = _SETTINGS["force"]
    why = None
    if entry is not None and not checked:
        why = _off_thread(call.out.device, cached_is_wrong, call, entry, level,
                          passed=lambda: _cache().mark_checked(k, here))
        if call.out.device.type == "cuda":
            torch.cuda.empty_cache()  # the check's scratch and fp32 reference not left reserved, as tuning's are not
    if why:
        print(f"resfuse: {call.op} {_shape(call)} {call.signature}: the cached choice {entry.provider} "
              f"{entry.config} is wrong here ({why[:200]}); measuring again")
        entry, replace = None, True
    if entry is None:
        remaining = _SETTINGS["budget_s"] - _STATE["spent_s"]
        if remaining <= 0:
            _CHOICES[fast] = UNTUNED  # budget spent: tuned by a later compile (configure forgets these)
            PROGRESS.op_done(f"resfuse: {call.op} {_shape(call)} {call.signature}: tuning budget spent, "
                             "runs cuDNN/cuBLAS + our epilogue kernel")
            return UNTUNED
        start = time.monotonic()
        PROGRESS.measuring()
        entry = _off_thread(call.out.device, tune, call, bench=_bench, level=level, budget_s=remaining,
                            report=PROGRESS.op_done)
        gc.collect()  # the benchmarks' CUDA graphs keep their private memory pools until they are collected
        if call.out.device.type == "cuda":  # and the caching allocator keeps tuning's scratch reserved, in a pool
            torch.cuda.empty_cache()  # that a CUDA-graphed model never allocates from again
        _STATE["spent_s"] += time.monotonic() - start
        if entry is None:
            # nothing matched the fp32 reference: run what eager runs, and don't measure this op again
            _CHOICES[fast] = UNFUSED
            return UNFUSED
        if _cache().put(k, entry, replace=replace):  # not where another process stored its own winner first
            _cache().mark_checked(k, here)  # the tuner checked its winner as cached_is_wrong would
    else:
        PROGRESS.op_done()  # a cache hit: no line
    # triton: its kernel config; cudnn: its engine config's name, and "fold_bn" where the batch norm is folded
    choice = Choice(entry.provider, space.config(call, entry.config) if entry.provider == "triton"
                    else dict(entry.config) or None)
    _CHOICES[fast] = choice
    return choice


def cached_is_wrong(call: Call, entry: Entry, level: str, passed=lambda: None) -> str | None:
    """Why the cached choice gives a wrong answer on `call`, or None: checked as the tuner checks a candidate, before
    its first use on a machine (cache.machine: this GPU and driver; `passed()` runs where it passes). A
    cache can hold a choice that an earlier check let through (before CHECK_VERSION 2, a cuDNN engine config that
    wrote nothing), or one made by another driver or GPU of the same name. A choice that is not among this level's
    candidates (cached by tuning "max"), or whose provider cannot build them here, runs unchecked."""
    def spelt(config: dict) -> str:  # a triton config with every field (one cached before a field existed: its
        # default), as the cache stores it
        full = dataclasses.asdict(space.config(call, config)) if entry.provider == "triton" else config
        return json.dumps(full, sort_keys=True)

    try:
        same = spelt(entry.config)
        found = [v for c in providers.candidates(call, level, allowed=(entry.provider,)) for v in (c, *c.variants)
                 if spelt(v.config) == same]  # a variant (bulk stores) may be the choice
    except Exception:  # noqa: BLE001  no candidates to check against: the choice runs as before the check
        return None
    if not found:
        return None
    why = select.check(found[0], _reference(call), TOLERANCE[call.inputs[0].dtype])
    if why is None:
        passed()
    return why


_OUT_OF_RESOURCES: set = set()  # fast keys of calls whose config of our kernel did not load here


def out_of_resources(call: Call, error: Exception) -> Choice:
    """What runs from now on instead of our kernel's config that did not load on this GPU (raised as it loads, before
    anything runs): cuDNN/cuBLAS + our epilogue kernel. The heuristic configs of tuning "none" assume a Hopper's
    shared memory, which other GPUs have less of; a tuned config was measured here and loads. Said once an op."""
    fast = fast_key(call)
    if fast not in _OUT_OF_RESOURCES:
        print(f"resfuse: {call.op} {_shape(call)} {call.signature}: our kernel's config does not fit this GPU, "
              f"running cuDNN/cuBLAS + our epilogue kernel: {' '.join(str(error).split())[:200]}")
    _OUT_OF_RESOURCES.add(fast)
    return UNTUNED


def _off_thread(device: torch.device, fn, *args, **kwargs):
    """Run the measurement on a worker thread, in step with this one. Under torch's CUDA graph trees a fused
    op's first call happens in a warm-up that sends every allocation of the calling thread into the graph's
    private pool, which never gives memory back: tuning's scratch buffers and benchmark graphs left a
    ResNet-50 bs256 training step holding 70 GB reserved instead of 14."""
    if device.type != "cuda":
        return fn(*args, **kwargs)
    torch.cuda.synchronize(device)  # the worker's stream must see the inputs the caller's stream wrote

    def work():
        torch.cuda.set_device(device)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize(device)

    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        return worker.submit(work).result()


def fast_key(call: Call) -> tuple:
    """What makes two calls in this process the same problem (versions cannot change; out holds the device), under
    the providers of the model making it (two compiled models may name different ones and run in turn). Cheap:
    the call's part is computed once a call (`Call.problem`; the SQLite key, `key`, queries the device)."""
    return (*call.problem, _SETTINGS["providers"])


def _tunable(device: torch.device) -> bool:
    return device.type == "cuda"  # interpreter timings on CPU say nothing about a GPU


def _bench(fn, rep_s: float = 5e-3, retries: int = 5) -> float:
    """Device time of one call, replayed from a CUDA graph: the host cost of launching is not the kernel's
    (resfuse is deployed with cuda_graphs=True where launches matter), and the Python of the unfused path
    would otherwise dwarf its kernels.

    triton.testing.do_bench_cudagraph sizes its graph from eager calls, which are host-bound here (a 10 us
    kernel behind 60 us of Python gets a graph of 300+ calls), and replays it 10 times for 20 ms: about 0.2 s
    of each candidate, most of a cold tuning's minute. Here the estimate comes from replaying a one-call graph,
    and a graph of at most 100 calls is replayed `retries` times for about `rep_s` each; the median counts."""
    from ..kernels.split_k import graph_tickets

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm-up and lazy initialisation, outside any capture
        one = torch.cuda.CUDAGraph()
        # split launches' tickets kept, as in a model; each graph's buffer is bound here, so it lives as the graph
        with graph_tickets(stream.device) as one_tickets, torch.cuda.graph(one):
            fn()
        estimate = _replay_s(one, 3)
        n = max(1, min(100, int(rep_s / max(estimate, 1e-7))))
        many = torch.cuda.CUDAGraph()
        with graph_tickets(stream.device) as many_tickets, torch.cuda.graph(many):
            for _ in range(n):
                fn()
        times = sorted(_replay_s(many, 1) / n for _ in range(retries))
    return times[len(times) // 2]


def _replay_s(graph, count: int) -> float:
    """Seconds per replay of `graph`, over `count` back-to-back replays timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / count


def tune(call: Call, *, bench, level: str, budget_s: float = float("inf"), report=print) -> Entry | None:
    """Measure the providers' candidates for `call` and return the winner as a cache entry.

    When no candidate matches the reference, the whole measurement runs once more from a fresh reference:
    inside models on the GPU every candidate, the unfused ATen one included, has been seen to miss a
    reference that a later recomputation agreed with (cause not found; BENCHMARKS.md). Twice wrong: None.
    """
    misses = []
    for attempt in (1, 2):
        reference = _reference(call)
        candidates = providers.candidates(call, level, allowed(call, tuple(providers.PROVIDERS)))
        if attempt == 1:
            compile_in_parallel(candidates, call.out.device)
            precompile.cudnn_built(call, level)  # its engine configs built on worker processes
        outcome = select.select(candidates, reference, bench=bench,
                                tol=TOLERANCE[call.inputs[0].dtype], top_k=2 if level == "fast" else 4,
                                budget_s=budget_s)
        if outcome.winner is not None:
            break
        misses.append(f"attempt {attempt}: {outcome.discarded}")
    if outcome.winner is None:
        report(f"resfuse: tuning {call.op} {_shape(call)} {call.signature} found no correct candidate, runs "
               f"unfused; " + "; ".join(misses))
        return None
    if misses:
        print(f"resfuse: {call.op} {_shape(call)} {call.signature}: every candidate missed a first reference, "
              f"then matched a fresh one ({misses[0][:300]})")
    best = outcome.times[outcome.winner.name]
    peer = "separate" if call.op in providers.separate.PAIRS else "aten"  # a pair's peer: its convs, each tuned
    base = outcome.times.get(peer)
    vs_peer = f"{base / best:.2f}x over {peer}" if base is not None else f"{peer} not measured"
    report(f"resfuse: tuned {call.op} {_shape(call)} {call.signature}: {outcome.winner.name} {best * 1e6:.1f} us, "
           f"{vs_peer}")
    top = dict(sorted(outcome.times.items(), key=lambda kv: kv[1])[:5])
    return Entry(outcome.winner.provider, outcome.winner.config, top)


def triton_launches(candidates: list) -> list:
    """Every callable of the candidates that launches our Triton kernels: each triton candidate with its epilogue
    (from the shapes alone where it has a triton_part), without it, and each of its variants; another provider's
    Triton kernel alone (the epilogue provider's epilogue kernel, without the conv before it: run in precompile's
    dry run, the conv cost MobileNetV3's capture 9 s)."""
    return [f for c in candidates
            for f in ((c.mainloop, c.triton_part or c.run, *(v.run for v in c.variants)) if c.provider == "triton"
                      else (c.triton_part,))
            if f is not None]


def compile_in_parallel(candidates: list, device: torch.device) -> None:
    """Build the candidates' Triton kernels (ours, and the epilogue provider's epilogue kernel) at once, before any
    is timed: first on worker processes (precompile.py: a dry run records each kernel, the workers compile it into
    Triton's disk cache), then each is launched once (with and without its epilogue, and each of its variants) on
    its scratch buffers from a thread pool, which loads what the workers compiled and compiles what they could not.
    On threads alone, a compile ran on its own thread for a third of its wall time and waited on the GIL or ptxas
    for the rest (MobileNetV3 bs32 on a 16-core H100 host: 759 compiles in 134 s).
    A failure here is ignored: select() meets it again and records why."""
    if device.type != "cuda":
        return  # under the interpreter nothing is compiled, and the interpreter is not thread-safe
    jobs = triton_launches(candidates)
    if len(jobs) < 2:
        return
    precompile.precompile(jobs)  # their kernels into Triton's disk cache, on worker processes

    def build(fn):
        torch.cuda.set_device(device)
        try:
            fn()
        except Exception:  # noqa: BLE001  (select reports it)
            pass

    with concurrent.futures.ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 4, 16)) as pool:
        list(pool.map(build, jobs))
    torch.cuda.synchronize(device)


def _shape(call: Call) -> str:
    return "x".join(map(str, call.out.shape))


def _reference(call: Call) -> torch.Tensor | tuple:
    """The unfused computation in fp32 from upcast inputs: what every candidate is checked against (a chain's:
    y and z, z computed from the fp32 y)."""
    up = dataclasses.replace(call, inputs=tuple(t.float() for t in call.inputs),
                             operands=[t.float() for t in call.operands],
                             out=dataclasses.replace(call.out, dtype=torch.float32), aux=None, stats=None)
    if call.op in providers.separate.PAIRS:
        return providers.separate.pair_op(call).reference(up)
    return providers.aten.run(up, up.out.empty())
