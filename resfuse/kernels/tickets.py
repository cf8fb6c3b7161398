"""Zero-at-rest tickets: int32 counters that a kernel's last program resets to 0 before it exits, kept from launch
to launch, so a launch whose programs elect a last one (batch_norm_bwd.py's partials pass) needs no zeroing kernel
or memset first.

Entry point: `take(device, key, n) -> int32 tensor of n zeros, or None`.

split_k.py takes zeroed tickets from the caching allocator per launch instead, one fill kernel each; where a
kernel would only save a launch by electing a last program, that fill would cost what it saves. Here all
tickets come from one pool a device, allocated once outside any CUDA graph capture (a buffer allocated inside a
capture lives in the graph's private pool and would outlive it). Slots are never shared by launches that may run
at once: outside a capture, a (key, stream) pair keeps its slots, and launches on one stream run one after another
(a programmatic dependent launch waits for the previous kernel's end before its first load, tiles.py); inside a
capture, each launch takes slots of its own, since graphs captured on one stream may be replayed on two. With no
pool yet (the first call is inside a capture) or the pool spent, `take` returns None and the caller takes its
path without tickets.
"""
from __future__ import annotations

import threading

import torch

POOL = 1 << 18  # int32 slots a device (1 MB): ResNet-50's backward graph takes about 600 a capture

_pools: dict = {}  # device -> the pool
_used: dict = {}  # device -> slots handed out
_slots: dict = {}  # (device, key, stream) -> that pair's slots


def take(device: torch.device, key, n: int) -> torch.Tensor | None:
    """n zero-at-rest tickets for a launch of `key` (its plan) on device's current stream, or None."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    if not capturing and (device, key, stream) in _slots:
        return _slots[device, key, stream]
    if device not in _pools:
        if capturing:
            return None
        _pools[device], _used[device] = _new_pool(device), 0
    if _used[device] + n > POOL:
        return None
    slots = _pools[device][_used[device]:_used[device] + n]
    _used[device] += n
    if not capturing:
        _slots[device, key, stream] = slots
    return slots


def _new_pool(device: torch.device) -> torch.Tensor:
    """POOL zeros, allocated by a thread of its own: CUDA graph trees route the warming-up thread's allocations to
    the graph's private pool (torch._C._cuda_beginAllocateCurrentThreadToPool), which refuses a tensor that
    outlives the graph."""
    made = []

    def alloc():
        made.append(torch.zeros(POOL, dtype=torch.int32, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # zeroed on that thread's stream before any launch reads it

    worker = threading.Thread(target=alloc)
    worker.start()
    worker.join()
    if not made:
        raise RuntimeError(f"could not allocate the ticket pool on {device}")
    return made[0]
