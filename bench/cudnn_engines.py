"""Every cuDNN engine config of one fused conv against ATen, with canaries around its workspace and output (GPU).

Entry point: `python bench/cudnn_engines.py [--x 32,480,1,1] [--w 20,480,1,1] [--epilogue "silu(add(acc,c0))"]`.
Written for the thirty-ninth session's wrong EfficientNet-B0 bs32 output: its squeeze-excitation conv (480 > 20
channels on a 1x1 image) ran cuDNN's eng4_k24=19 with a relative error of 1.0 in the model, where the tuner had
checked that engine right. For each layout of the input and each engine config in cuDNN's ranked list, it runs the
graph `--calls` times through resfuse's own `Plan.run` and through a binding whose workspace and output sit inside
buffers filled with a byte pattern, and prints each call's relative error against the unfused ATen conv and how
many pattern bytes outside the workspace and the output changed (a write out of bounds).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from resfuse.bench import timing  # noqa: E402
from resfuse.ops import fused  # noqa: E402
from resfuse.providers import cudnn  # noqa: E402

PAD, MARK = 1 << 20, 0x5A


def fenced(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a buffer of PAD pattern bytes, nbytes, PAD pattern bytes; its middle)."""
    whole = torch.full((2 * PAD + nbytes,), MARK, dtype=torch.uint8, device="cuda")
    return whole, whole[PAD:PAD + nbytes]


def changed(whole: torch.Tensor, nbytes: int) -> int:
    return int((whole[:PAD] != MARK).sum() + (whole[PAD + nbytes:] != MARK).sum())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--x", default="32,480,1,1")
    p.add_argument("--w", default="20,480,1,1")
    p.add_argument("--epilogue", default="silu(add(acc,c0))")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    x_shape, w_shape = ([int(v) for v in s.split(",")] for s in (args.x, args.w))
    params = ([1, 1], [0, 0], [1, 1])
    for layout in (torch.channels_last, torch.contiguous_format):
        x = torch.randn(x_shape, device="cuda").half().contiguous(memory_format=layout)
        w = (torch.randn(w_shape, device="cuda") * 0.05).half().contiguous(memory_format=layout)
        b = torch.randn(w_shape[0], device="cuda").half()
        call = fused.call_of("conv2d", (x, w), [b], args.epilogue, params)
        ref = fused.conv2d_reference(x, w, [b], args.epilogue, *params, call.out.empty())
        plan = cudnn._plan(call)
        out_bytes = ref.numel() * ref.element_size()
        print(f"x strides {x.stride()}, w strides {w.stride()}, out strides {tuple(call.out.strides)}: "
              f"{len(plan.engines)} engine configs", flush=True)
        for index, name in enumerate(plan.engines):
            try:
                own = [timing.output_error([plan.run(call, call.out.empty(), name)], [ref])[0]
                       for _ in range(args.calls)]
                ws = plan.built[name][1]
                ws_whole, workspace = fenced(max(1, ws))
                y_whole, y_bytes = fenced(out_bytes)
                y = y_bytes.view(torch.float16).as_strided(ref.shape, ref.stride())
                binding = {plan.x: x, plan.w: w, plan.y: y}
                binding.update({t: plan._operand(call, slot) for slot, t in plan.operands.items()})
                fenced_errs = []
                for _ in range(args.calls):
                    y.fill_(float("nan"))
                    plan.graph.execute_plan_at_index(binding, workspace, index=index, handle=plan.handle)
                    torch.cuda.synchronize()
                    fenced_errs.append(timing.output_error([y], [ref])[0])
                print(f"  {index:2d} {name:<28} workspace {ws:>9} B  own run {' '.join(f'{e:.1e}' for e in own)}"
                      f"  fenced {' '.join(f'{e:.1e}' for e in fenced_errs)}  bytes changed outside: workspace "
                      f"{changed(ws_whole, max(1, ws))}, output {changed(y_whole, out_bytes)}", flush=True)
            except Exception as e:  # an engine config that does not build here is a line, not the end
                print(f"  {index:2d} {name:<28} {type(e).__name__}: {str(e)[:120]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
