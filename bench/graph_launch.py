"""The host cost of replaying a CUDA graph, per node, by who launched the node (GPU machine).

  python3 bench/graph_launch.py --out $OUT

A graph replay costs the host time in cudaGraphLaunch, which grows with the graph's nodes. For each kind of
launch a resfuse graph holds (ATen's kernels, cuBLAS, our Triton kernels with and without TMA descriptors, our
depthwise kernel, a cuDNN fused-conv plan, an Inductor kernel), this captures 100 launches of it in one graph
and times graph.replay() on the host. Our kernels launch under programmatic dependent launch by default; each also
runs with it off, to see whether PDL's graph edges cost the host (the forty-third session timed a ResNet-50 bs1
replay at 36-148 us of host, ten times the per-node cost measured here before PDL). Then mixes of the kinds, and
50 distinct compiled kernels in turn against one kernel 50 times: their rows are per round (one launch of each
member), NODES rounds a graph: do mixing kinds, PDL edges or distinct kernel modules make a node dearer? None
did (forty-fourth session: 0.01-0.1 us a launch); the 0.35-1.0 us a node that bench/replay_gaps.py had timed in a
model's graph were the host's slow windows. bs1 MobileNet shapes (fp16, channels_last).
"""
import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from resfuse import kernels  # noqa: E402
from resfuse.kernels.conv2d_depthwise import DepthwiseConfig  # noqa: E402
from resfuse.kernels.matmul import GemmConfig  # noqa: E402
from resfuse.ops.fused import Output  # noqa: E402
from resfuse.tuning.choose import Call  # noqa: E402

NODES = 100


def replay_host_us(launch, replays: int = 50) -> tuple[float, float]:
    """(host us per node of graph.replay(), GPU us per node) for a graph of NODES launches. The host time is
    the median of single replays each started on an idle GPU, so a full launch queue never blocks it."""
    launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(NODES):
            launch()
    g.replay()
    torch.cuda.synchronize()
    host = []
    for _ in range(replays):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        host.append(time.perf_counter() - t0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return sorted(host)[replays // 2] / NODES * 1e6, start.elapsed_time(end) * 1e3 / replays / NODES


def without_pdl(launch):
    """launch() with programmatic dependent launch off: its graph nodes get no programmatic edges."""
    def run():
        before = kernels.options()["pdl"]
        kernels.set_options(pdl=False)
        try:
            launch()
        finally:
            kernels.set_options(pdl=before)
    return run


@triton.jit
def _bump(x_ptr, n, K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + K, mask=offs < n)


def distinct_kernels(x, count: int = 50):
    """Launches of `count` distinct compiled kernels in turn (one Triton kernel specialised on K = 0..count-1: a
    module each, as a model graph's kernels are), against one of them `count` times."""
    n = x.numel()
    for k in range(count):  # compiled outside the capture
        _bump[(triton.cdiv(n, 128),)](x, n, K=k, BLOCK=128)
    torch.cuda.synchronize()
    return (lambda: [_bump[(triton.cdiv(n, 128),)](x, n, K=k, BLOCK=128) for k in range(count)],
            lambda: [_bump[(triton.cdiv(n, 128),)](x, n, K=0, BLOCK=128) for _ in range(count)])


def cases():
    dev, h = "cuda", torch.float16
    a, b = torch.randn(196, 80, device=dev, dtype=h), torch.randn(80, 480, device=dev, dtype=h)
    bias, c = torch.randn(480, device=dev, dtype=h), torch.empty(196, 480, device=dev, dtype=h)
    x = torch.randn(1, 480, 14, 14, device=dev, dtype=h).to(memory_format=torch.channels_last)
    w_dw = torch.randn(480, 1, 3, 3, device=dev, dtype=h)
    w_pw = torch.randn(80, 480, 1, 1, device=dev, dtype=h).to(memory_format=torch.channels_last)
    out_dw = torch.empty_like(x)
    y = torch.empty(1, 80, 14, 14, device=dev, dtype=h).to(memory_format=torch.channels_last)
    bias80 = torch.randn(80, device=dev, dtype=h)
    inductor = torch.compile(lambda t: torch.relu(t) * 2.0)
    from resfuse.providers import cudnn

    call = Call("conv2d", (x, w_pw), [bias80], "relu(add(acc,c0))", ([1, 1], [0, 0], [1, 1]), Output.like(y))
    kinds = {
        "aten add": lambda: torch.add(c, c, out=c),
        "cuBLAS mm": lambda: torch.mm(a, b, out=c),
        "ATen conv (cuDNN)": lambda: torch.convolution(x, w_pw, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
        "Inductor kernel": lambda: inductor(c),
        "resfuse gemm": lambda: kernels.gemm(a, b, [bias], "add(acc,c0)", c, GemmConfig(64, 64, 64, num_warps=4)),
        "resfuse gemm TMA": lambda: kernels.gemm(a, b, [bias], "add(acc,c0)", c,
                                                 GemmConfig(64, 64, 64, num_warps=4, tma=True)),
        "resfuse depthwise": lambda: kernels.conv2d(x, w_dw, [bias.new_zeros(480)], "add(acc,c0)", [1, 1], [1, 1],
                                                    [1, 1], out_dw, DepthwiseConfig(4, 8, 32, 2)),
        "cuDNN fused plan": lambda: cudnn.run(call, y),
    }
    for name in ("resfuse gemm", "resfuse gemm TMA", "resfuse depthwise"):  # PDL is on by default (plan.pdl_meta)
        kinds[f"{name}, PDL off"] = without_pdl(kinds[name])
    ours = ("resfuse gemm", "resfuse gemm TMA", "resfuse depthwise")
    theirs = ("aten add", "cuBLAS mm", "ATen conv (cuDNN)", "Inductor kernel", "cuDNN fused plan")
    mixes = {  # each NODES rounds of its kinds in turn: which mix makes a node cost more than alone?
        "all of them, in turn": list(kinds),
        "mix: ours and theirs, PDL on": [*ours, *theirs],
        "mix: ours and theirs, PDL off": [f"{k}, PDL off" for k in ours] + list(theirs),
        "mix: ours alone, PDL on": list(ours),
        "mix: ours alone, PDL off": [f"{k}, PDL off" for k in ours],
        "mix: theirs alone": list(theirs),
        "mix: two gemms, PDL on": ["resfuse gemm", "resfuse gemm TMA"],
    }
    for name, members in mixes.items():
        kinds[name] = lambda launches=[kinds[k] for k in members]: [launch() for launch in launches]
    distinct, same = distinct_kernels(torch.zeros(4096, device=dev))
    kinds["50 distinct kernels, in turn"], kinds["one kernel, 50 times"] = distinct, same
    return kinds


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    rows = {}
    for name, launch in cases().items():
        try:
            rows[name] = replay_host_us(launch)
        except Exception as e:  # one kind failing to capture is a result too
            rows[name] = (float("nan"), float("nan"))
            print(f"{name}: {type(e).__name__}: {e}")
    with open(os.path.join(args.out, "graph_launch.json"), "w") as f:
        json.dump({k: {"host_us_per_node": v[0], "gpu_us_per_node": v[1]} for k, v in rows.items()}, f, indent=1)
    print(f"{'launch kind':<34}{'host us/node':>14}{'GPU us/node':>13}")
    for name, (host, gpu) in rows.items():
        print(f"{name:<34}{host:>14.2f}{gpu:>13.2f}")


if __name__ == "__main__":
    main()
