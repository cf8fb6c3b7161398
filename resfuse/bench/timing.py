"""How one peer is measured: first-call time, steady-state latency, numerics against eager, top kernels.

Entry points: `input_sets`, then for each peer `measure` (`first_call`, `output_error`, `latency`, and the
error of a timed call), and with --profile `kernels`. run.py and bench/ab.py call them; the bench scripts also
`host_us` (the host's time a call) and `gpu_us` (the GPU's, calls queued behind a sleep). `Clocks` reads the
GPU's SM clock while calls run: `latency` records it beside its times.

Latency on CUDA is timed with CUDA events around each call, after a warm-up, as the median of many calls;
the inputs rotate among several preallocated sets so that no call finds its input already in L2 from the
call before. On CPU the host clock (time.perf_counter) times each call; run.py prints that CPU numbers
say nothing about speed on a GPU.
"""
from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves


@dataclasses.dataclass
class Latency:
    median_ms: float
    min_ms: float
    p90_ms: float
    iters: int
    method: str  # "cuda-events" or "perf_counter"
    clock: dict | None = None  # Clocks.summary() over the timed calls: None on CPU or without NVML


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def input_sets(inputs: tuple, count: int = 4) -> list[tuple]:
    """`inputs` plus count-1 fresh sets of the same shapes, dtypes, layouts (never zeros); the first set is
    the original, so the numerics check sees the inputs the floor was traced with."""
    sets = [inputs]
    for _ in range(count - 1):
        sets.append(tuple(_fresh(x) for x in inputs))
    return sets


def _fresh(x):
    if not isinstance(x, torch.Tensor):
        return x
    if x.is_floating_point():
        return torch.randn_like(x)  # randn_like keeps x's strides, so channels_last stays channels_last
    if x.dtype == torch.bool:
        return x.clone()
    return torch.randint_like(x, 0, int(x.max()) + 1)  # token ids stay inside the vocabulary seen


def _detached_outputs(out) -> list[torch.Tensor]:
    # Cloned at once: a CUDA-graph peer overwrites its output buffers on the next replay.
    return [t.detach().clone() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def first_call(fn: Callable, inputs: tuple, device: torch.device) -> tuple[float, list[torch.Tensor]]:
    """Wall seconds of the first call (compilation and tuning included) and its outputs."""
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(*inputs)
    _sync(device)
    return time.perf_counter() - t0, _detached_outputs(out)


def run_once(fn: Callable, inputs: tuple) -> list[torch.Tensor]:
    with torch.no_grad():
        return _detached_outputs(fn(*inputs))


def output_error(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> tuple[float, float]:
    """(max over outputs of ||out - ref|| / ||ref||, max |out - ref|), computed in float64.

    A shape mismatch or a non-finite value gives inf: it must never read as a small error."""
    if len(outs) != len(refs):
        return float("inf"), float("inf")
    rel, absolute = 0.0, 0.0
    for out, ref in zip(outs, refs):
        if out.shape != ref.shape:
            return float("inf"), float("inf")
        if not ref.is_floating_point():
            continue
        diff = out.double() - ref.double()
        if not torch.isfinite(diff).all():
            return float("inf"), float("inf")
        rel = max(rel, (diff.norm() / ref.double().norm().clamp_min(1e-30)).item())
        absolute = max(absolute, diff.abs().max().item() if diff.numel() else 0.0)
    return rel, absolute


def latency(fn: Callable, sets: list[tuple], device: torch.device, iters: int,
            warmup: int | None = None) -> Latency:
    warmup = max(3, iters // 10) if warmup is None else warmup
    with torch.no_grad():
        for i in range(warmup):
            fn(*sets[i % len(sets)])
        _sync(device)
        clock = None
        if device.type == "cuda":
            with Clocks(device) as clocks:
                times = _cuda_event_times(fn, sets, iters)
            clock, method = clocks.summary(), "cuda-events"
        else:
            times = []
            for i in range(iters):
                t0 = time.perf_counter()
                fn(*sets[i % len(sets)])
                times.append((time.perf_counter() - t0) * 1e3)
            method = "perf_counter"
    ordered = sorted(times)
    return Latency(statistics.median(times), ordered[0], ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
                   iters, method, clock)


# NVML's clock-event reasons that lower the clock below what the work asks for: software power cap, hardware
# slowdown, software and hardware thermal slowdown, power brake (nvml.h, nvmlClocksEventReason*).
LIMITED = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


class Clocks:
    """The GPU's SM clock and its limits, read through NVML (nvidia-ml-py) every `every_s` in a thread while the
    `with` block runs: a GPU held at its power limit lowers its clock, and a call's time with it. On an H200
    (forty-seventh session, bench/sustained.py) ResNet-50 bs256 took 5.82 ms a call from an idle GPU, at 1980
    MHz, and 6.3 ms held busy, at a median 1740 MHz and 700 W: the same kernels. Reads nothing on CPU, or where
    NVML cannot be loaded or does not know the device."""

    def __init__(self, device: torch.device, every_s: float = 0.01):
        self.reads: list[tuple[int, int]] = []  # (SM MHz, clock-event reasons)
        self.every_s, self.max_mhz, self._read = every_s, None, None
        self.nv = self.handle = None  # pynvml and the device's handle, where NVML knows the device
        self._done = threading.Event()
        if device.type != "cuda":
            return
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            # by UUID: NVML's indices ignore CUDA_VISIBLE_DEVICES
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
            self.max_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
        except pynvml.NVMLError:  # no driver library, a MIG slice, a device it does not know: the clock stays unread
            return
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self.nv, self.handle = pynvml, handle
        self._read = lambda: (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM), reasons(handle))

    def __enter__(self):
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        if self._read is not None:
            self._thread.join()

    def _run(self):
        while True:
            self.reads.append(self._read())
            if self._done.wait(self.every_s):
                return

    def summary(self) -> dict | None:
        """{"sm_mhz": the median read, "max_mhz": the GPU's highest SM clock, "limited": the share of reads with a
        power or thermal limit on}, or None where nothing was read."""
        if not self.reads:
            return None
        return {"sm_mhz": statistics.median(r[0] for r in self.reads), "max_mhz": self.max_mhz,
                "limited": sum(bool(r[1] & LIMITED) for r in self.reads) / len(self.reads)}


@dataclasses.dataclass
class Measured:
    first_s: float  # the first call's wall time: compilation and tuning included
    outs: list[torch.Tensor]  # the first call's outputs
    first_err: tuple[float, float]  # (relative, absolute) of the first call's outputs against refs
    late_err: tuple[float, float]  # the same for a call after the timed ones, on the last input set
    latency: Latency

    @property
    def rel_err(self) -> float:
        return max(self.first_err[0], self.late_err[0])

    @property
    def abs_err(self) -> float:
        return max(self.first_err[1], self.late_err[1])


def measure(fn: Callable, sets: list[tuple], refs: list[torch.Tensor], late_refs: list[torch.Tensor],
            device: torch.device, iters: int) -> Measured:
    """One peer: its first call against `refs` (eager's outputs on sets[0]), its latency over the rotated sets, and
    a call after the timed ones against `late_refs` (eager's on sets[-1]): a CUDA-graph peer captures its graph
    after the first call, so the first call alone would not check what the timed calls replay."""
    first_s, outs = first_call(fn, sets[0], device)
    first_err = output_error(outs, refs)
    lat = latency(fn, sets, device, iters)
    return Measured(first_s, outs, first_err, output_error(run_once(fn, sets[-1]), late_refs), lat)


def host_us(fn: Callable, inputs: tuple, device: torch.device, calls: int = 50) -> float:
    """Median host time of one call in us, the GPU idle when each starts (a sync before each call, outside the
    timing): a deep launch queue would otherwise block the host on the GPU and time the GPU instead. Beside the
    latency it tells whether the host sets the pace: back to back, a call whose host time passes its GPU time
    runs at the host's."""
    times = []
    with torch.no_grad():
        for _ in range(calls):
            _sync(device)
            t0 = time.perf_counter()
            fn(*inputs)
            times.append(time.perf_counter() - t0)
    _sync(device)
    return sorted(times)[len(times) // 2] * 1e6


def gpu_us(fn: Callable, sets: list[tuple], calls: int = 20, sleep_cycles: int = 40_000_000, tries: int = 4) -> float:
    """GPU time of one call in us, the host's pace left out: the calls are queued behind a sleep kernel and run
    back to back once it ends, timed by two CUDA events. Where the host enqueued slower than the sleep lasted
    (the GPU caught up), the sleep doubles and the calls run again, `tries` times in all; then RuntimeError (a
    call that waits on the GPU, or more launches than the GPU's queue holds: try fewer calls). A noisy host moves
    latency() (each call's events wrap its host work too), not this."""
    with torch.no_grad():
        for _ in range(tries):
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
            gate, start, end = torch.cuda.Event(), torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            gate.record()
            start.record()
            for i in range(calls):
                fn(*sets[i % len(sets)])
            end.record()
            caught_up = gate.query()
            torch.cuda.synchronize()
            if not caught_up:
                return start.elapsed_time(end) / calls * 1e3
            sleep_cycles *= 2
    raise RuntimeError(f"the host never enqueued {calls} calls within a sleep of {sleep_cycles // 2} cycles")


def _cuda_event_times(fn: Callable, sets: list[tuple], iters: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(*sets[i % len(sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def kernels(fn: Callable, sets: list[tuple], device: torch.device, iters: int = 5) -> list[dict]:
    """Every kernel (CUDA) or ATen op (CPU) by self time under torch.profiler, per iteration, slowest first.
    Their calls add up to the launches per iteration, their times to the device's busy time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        for i in range(iters):
            fn(*sets[i % len(sets)])
        _sync(device)
    rows = []
    for evt in prof.key_averages():
        if cuda and evt.device_type != DeviceType.CUDA:
            continue
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if us > 0:
            rows.append({"name": evt.key, "time_us": us / iters, "calls": evt.count // iters})
    rows.sort(key=lambda r: r["time_us"], reverse=True)
    total = sum(r["time_us"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["time_us"] / total
    return rows
