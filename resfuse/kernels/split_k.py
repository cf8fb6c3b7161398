"""Split-K that is correct for any epilogue: fp32 partials to a workspace, the epilogue once on the full sum.

Entry points: `split_k_reduce` (@triton.jit, called by every generated kernel when SPLIT_K > 1) and
`buffers(device, tiles, split, bm, bn)` (the per-device workspace and tickets, called by launch.py).

CUTLASS #391 ran the epilogue per partition, which is wrong for a nonlinear activation or a mul. Here every
split stores its fp32 partial, then takes a ticket for its output tile with an atomic add; the split that
draws the last ticket sums the partials in fixed order 0..S-1 (so results are bit-identical run to run, and
do not depend on arrival order), resets the ticket to 0 for the next launch, and alone runs the epilogue.
The tickets are shared by every launch on a device, which is safe because launches on one stream are
ordered; kernels on two streams at once would need their own (not supported).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_WORKSPACE: dict[torch.device, torch.Tensor] = {}
_TICKETS: dict[torch.device, torch.Tensor] = {}


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
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        # .cg reads through L2, where the other programs' partials are, not a stale L1 line
        total += tl.load(base + i * (BM * BN) + offs, mask=last, other=0.0, cache_modifier=".cg")
    tl.store(tickets + tile, 0, mask=last)
    return total, last


def buffers(device: torch.device, tiles: int, split: int, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A workspace of tiles*split*bm*bn fp32 (a 1-element dummy without split-K) and at least `tiles` zeroed
    tickets (kept per device, grown on demand)."""
    if split > 1:
        # from the caching allocator per launch, freed (stream-ordered) when the launch is done: a buffer kept
        # at the largest size ever asked for (tuning tries split-K on the biggest layers) held GBs for good
        ws = torch.empty(tiles * split * bm * bn, dtype=torch.float32, device=device)
    else:
        ws = _WORKSPACE.get(device)
        if ws is None:
            ws = _WORKSPACE[device] = torch.empty(1, dtype=torch.float32, device=device)
    need_t = max(1, tiles) if split > 1 else 1
    tickets = _TICKETS.get(device)
    if tickets is None or tickets.numel() < need_t:
        # new tickets start at 0; every launch leaves the tickets it used back at 0
        tickets = _TICKETS[device] = torch.zeros(need_t, dtype=torch.int32, device=device)
    return ws, tickets
