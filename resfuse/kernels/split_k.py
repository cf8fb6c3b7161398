"""Split-K that is correct for any epilogue: fp32 partials to a workspace, the epilogue once on the full sum.

Entry points: `split_k_reduce` (@triton.jit, called by every generated kernel when SPLIT_K > 1),
`buffers(out, tiles, split, bm, bn)` (one launch's workspace and tickets, called by plan.py) and
`graph_tickets(device)` (around a CUDA graph's capture: the tickets its split launches share).

CUTLASS #391 ran the epilogue per partition, which is wrong for a nonlinear activation or a mul. Here every
split stores its fp32 partial, then takes a ticket for its output tile with an atomic add; the split that
draws the last ticket sums the partials in fixed order 0..S-1 (so results are bit-identical run to run, and
do not depend on arrival order), alone runs the epilogue, and puts the ticket back at zero.

The workspace comes from the caching allocator per launch (no kernel: it is written before it is read). The
tickets must start at zero, and zeroing a fresh buffer is a kernel of its own: at batch 1 it cost a split conv
1.4-1.9 us of its 5-9 (BENCHMARKS.md, thirty-fourth session). Since every launch leaves its tickets at zero, a
zeroed buffer is kept and reused instead:
  - per CUDA stream for launches outside a capture: a stream's launches run one after another (a programmatic
    dependent launch waits for the kernel before it at its first statement), and two streams never share one
    (at most MAX_STREAMS buffers, the oldest dropped). Each is allocated on a thread and a stream of split_k's
    own, outside any graph pool (`_zeroed_for`);
  - per captured graph, from `graph_tickets` around the capture: its launches replay in capture order, and the
    graph's owner keeps the buffer as long as the graph. A stream's buffer is not used there: a replay may run
    beside that stream's later launches.
A capture without `graph_tickets` (torch's CUDA graph trees in training) and a launch of more tiles than a
kept buffer holds take a zeroed buffer of their own, as before: nothing allocated in a graph's private pool may
outlive the graph's own tensors (graph trees refuse that).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading

import torch
import triton
import triton.language as tl

KEPT_TICKETS = 1 << 14  # tickets a kept buffer holds (64 KB): a split launch of more output tiles zeroes its own
_STREAMS: dict = {}  # (device, stream handle) -> a kept buffer for launches outside a capture, oldest first
MAX_STREAMS = 64  # kept buffers at most (torch's stream pools hold 32 a priority a device; external streams more)
_ALLOC_STREAMS: dict = {}  # device -> the stream its kept buffers are allocated and zeroed on (_zeroed_for)
_ALLOCATOR = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resfuse-split-k")  # ... on this thread
_CAPTURE = threading.local()  # .tickets: the buffer of the graph this thread is capturing (graph_tickets)


@triton.jit
def split_k_reduce(acc, ws, tickets, tile, pid_k, BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr):
    """Returns (the full fp32 sum, is this program the last of its tile); only the last one's sum is valid."""
    offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    base = ws + tile.to(tl.int64) * (SPLIT_K * BM * BN)
    tl.store(base + pid_k * (BM * BN) + offs, acc)
    # All threads' partial stores must be issued before one thread's release of the ticket.
    tl.debug_barrier()
    arrived = tl.atomic_add(tickets + tile, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    total = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        # .cg reads through L2, where the other programs' partials are, not a stale L1 line
        total += tl.load(base + i * (BM * BN) + offs, mask=last, other=0.0, cache_modifier=".cg")
    tl.atomic_xchg(tickets + tile, 0, mask=last)  # the ticket back at zero: a kept buffer needs no zeroing
    return total, last


def buffers(out: torch.Tensor, tiles: int, split: int, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A workspace of tiles*split*bm*bn fp32 and `tiles` zeroed tickets. Without split-K the kernel reads
    neither (its SPLIT_K == 1 branch is compiled out), so `out` stands in for both."""
    if split == 1:
        return out, out
    ws = torch.empty(tiles * split * bm * bn, dtype=torch.float32, device=out.device)
    kept = _kept(out.device) if tiles <= KEPT_TICKETS else None  # a tensor's device has its index
    return ws, kept[:tiles] if kept is not None else torch.zeros(max(1, tiles), dtype=torch.int32, device=out.device)


def _kept(device: torch.device) -> torch.Tensor | None:
    """The kept ticket buffer for a launch now on `device` (see the module's docstring), or None."""
    if device.type != "cuda":
        return None  # the interpreter launches no zeroing kernel to save
    if torch.cuda.is_current_stream_capturing():
        tickets = getattr(_CAPTURE, "tickets", None)
        return tickets if tickets is not None and tickets.device == device else None
    stream = torch.cuda.current_stream(device)
    # keyed by the device with its index (cuda and cuda:0 are one) and the stream
    return _stream_buffer((stream.device, stream.cuda_stream), lambda: _zeroed_for(stream))


def _stream_buffer(key: tuple, make) -> torch.Tensor:
    """The kept buffer of the stream `key`, `make()` on first use; past MAX_STREAMS the oldest goes."""
    if key not in _STREAMS:
        if len(_STREAMS) >= MAX_STREAMS:
            del _STREAMS[next(iter(_STREAMS))]
        _STREAMS[key] = make()
    return _STREAMS[key]


def _zeroed_for(stream: torch.cuda.Stream) -> torch.Tensor:
    """A zeroed ticket buffer for `stream`'s launches, allocated and zeroed outside the private pool that torch's CUDA
    graph trees route the warm-up thread's allocations to (they check that pool for live tensors they do not track,
    which a kept buffer would be): on a thread of split_k's own (the routing is per thread, whatever the stream),
    and there on a stream of its own (off the legacy default stream, which synchronises with every other).
    `stream` waits for the zeroing, and the allocator waits for `stream`'s work before it reuses the block (a
    dropped buffer)."""
    if stream.device not in _ALLOC_STREAMS:
        _ALLOC_STREAMS[stream.device] = torch.cuda.Stream(stream.device)
    own = _ALLOC_STREAMS[stream.device]

    def zeroed():
        with torch.cuda.stream(own):
            return torch.zeros(KEPT_TICKETS, dtype=torch.int32, device=stream.device)
    tickets = _ALLOCATOR.submit(zeroed).result()
    stream.wait_stream(own)
    tickets.record_stream(stream)
    return tickets


@contextlib.contextmanager
def graph_tickets(device: torch.device):
    """Around the capture of a CUDA graph on `device` (entered first, before torch.cuda.graph): yields the
    zeroed ticket buffer its split launches share. The caller must hold it as long as it replays the graph
    (`with graph_tickets(d) as tickets, ...`): nothing else does, and a freed buffer's memory is reused."""
    tickets = torch.zeros(KEPT_TICKETS, dtype=torch.int32, device=device)
    outer, _CAPTURE.tickets = getattr(_CAPTURE, "tickets", None), tickets
    try:
        yield tickets
    finally:
        _CAPTURE.tickets = outer
