"""Split-K that is correct for any epilogue: fp32 partials to a workspace, the epilogue once on the full sum.

Entry points: `split_k_reduce` (@triton.jit, called by every generated kernel when SPLIT_K > 1) and
`buffers(out, tiles, split, bm, bn)` (one launch's workspace and tickets, called by launch.py).

CUTLASS #391 ran the epilogue per partition, which is wrong for a nonlinear activation or a mul. Here every
split stores its fp32 partial, then takes a ticket for its output tile with an atomic add; the split that
draws the last ticket sums the partials in fixed order 0..S-1 (so results are bit-identical run to run, and
do not depend on arrival order), and alone runs the epilogue. Workspace and tickets come from the
caching allocator per launch (freed stream-ordered when it is done), so launches on two streams never share
them, and nothing allocated inside a CUDA graph's private pool outlives the graph's own tensors (torch's
CUDA graph trees refuse that).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    return total, last


def buffers(out: torch.Tensor, tiles: int, split: int, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A workspace of tiles*split*bm*bn fp32 and `tiles` zeroed tickets. Without split-K the kernel reads
    neither (its SPLIT_K == 1 branch is compiled out), so `out` stands in for both."""
    if split == 1:
        return out, out
    ws = torch.empty(tiles * split * bm * bn, dtype=torch.float32, device=out.device)
    return ws, torch.zeros(max(1, tiles), dtype=torch.int32, device=out.device)
