"""Which block of a model makes resfuse's fp16 output further from fp32 than eager's (GPU machine; CPU to smoke-test).

Entry point: `python bench/block_error.py [--model regnety_040] [--batch 32] [--units "stem,s1.*,...,head"]`.
The fortieth and forty-first sessions found RegNetY-040 the one zoo model where resfuse+graphs is further from the
model run in fp32 than eager is (1.15-1.23x, at bs 1, 32 and 256). This runs the model as a chain of units (a
module, or `name.*` for each child of a container), in fp32 with TF32 off, and feeds each unit the fp32 chain's
input, rounded to fp16, three ways: the unit in fp32 (the reference), in fp16 eagerly, and in fp16 compiled by
resfuse (tuned, without CUDA graphs: a graph replays the same kernels). Prints each unit's relative error against
the reference for eager and resfuse, and their ratio, so a unit whose ratio stands out names the op to look at;
the tuner's lines above the table say which provider took each of its ops. The chain is checked first: its fp32
output must be the model's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import resfuse  # noqa: E402
from resfuse.bench import models, timing  # noqa: E402

UNITS = {"regnety_040": "stem,s1.*,s2.*,s3.*,s4.*,final_conv,head",
         "hf-resnet50": "model.resnet.embedder,model.resnet.encoder.stages.*.layers.*,model.resnet.pooler,"
                        "model.classifier",
         "resnet50": "conv1,bn1,relu,maxpool,layer1.*,layer2.*,layer3.*,layer4.*,avgpool,flatten,fc"}


def units(model: torch.nn.Module, spec: str) -> list[tuple[str, torch.nn.Module]]:
    out = []
    for item in spec.split(","):
        if item == "flatten":  # torchvision's resnet flattens between avgpool and fc inside forward()
            out.append((item, torch.nn.Flatten(1)))
            continue
        parts = item.split(".")
        level = [("", model)]
        for part in parts:
            if part == "*":
                level = [(f"{n}.{c}" if n else c, child) for n, m in level for c, child in m.named_children()]
            else:
                level = [(f"{n}.{part}" if n else part, getattr(m, part)) for n, m in level]
        out += level
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="regnety_040")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--units", default=None, help="comma list; default: this script's list for the model")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    wide, (x,) = models.load(args.model, args.batch, torch.float32, device, image_size=args.image_size)
    half, _ = models.load(args.model, args.batch, torch.float16, device, image_size=args.image_size)
    spec = args.units or UNITS[args.model]
    chain32, chain16 = units(wide, spec), units(half, spec)
    rows = []
    with torch.no_grad():
        whole = wide(x)
        h = x
        inputs = []
        for _, unit in chain32:
            inputs.append(h)
            h = unit(h)
        drift = timing.output_error([h], [whole])[0]
        print(f"{args.model}: the chain of {len(chain32)} units against the model, fp32: {drift:.1e}")
        if drift > 1e-5:
            print("the units do not compose to the model: give --units")
            return 1
        end16 = {"eager": x.half(), "resfuse": x.half()}
        for (name, u32), (_, u16), h32 in zip(chain32, chain16, inputs):
            ref = u32(h32)
            h16 = h32.half().contiguous(memory_format=torch.channels_last) if h32.dim() == 4 else h32.half()
            fused = resfuse.compile(u16, cuda_graphs=False)
            row = {"unit": name, "eager": timing.output_error([u16(h16)], [ref])[0],
                   "resfuse": timing.output_error([fused(h16)], [ref])[0]}
            end16 = {"eager": u16(end16["eager"]), "resfuse": fused(end16["resfuse"])}  # the fp16 chains run on
            row["eager_chain"] = timing.output_error([end16["eager"]], [ref])[0]
            row["resfuse_chain"] = timing.output_error([end16["resfuse"]], [ref])[0]
            row["paths"] = sorted({f"{s} {path}" for (op, s, path) in _paths()})
            rows.append(row)
            torch._dynamo.reset()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"block_error_{args.model}_bs{args.batch}.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{args.model} bs{args.batch}: relative error against the unit in fp32, its input the fp32 chain's "
          "(one unit alone), and along the fp16 chain so far (chain)")
    print(f"{'unit':14s} {'eager':>9s} {'resfuse':>9s} {'ratio':>6s} {'eager chain':>12s} {'rf chain':>9s} "
          f"{'ratio':>6s}")
    for r in rows:
        print(f"{r['unit']:14s} {r['eager']:9.2e} {r['resfuse']:9.2e} {r['resfuse'] / max(r['eager'], 1e-30):6.2f} "
              f"{r['eager_chain']:12.2e} {r['resfuse_chain']:9.2e} "
              f"{r['resfuse_chain'] / max(r['eager_chain'], 1e-30):6.2f}")
    return 0


def _paths():
    from resfuse.ops import PATHS

    paths = dict(PATHS)
    PATHS.clear()
    return paths


if __name__ == "__main__":
    sys.exit(main())
