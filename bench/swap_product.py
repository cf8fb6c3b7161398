"""The swapped 1x1 conv as resfuse runs it (kernels.conv2d with ConvConfig.swap), beside bench/swap_ab.py's probe
kernel, on ResNet-50's bs1 1x1 convs (GPU machine).

  python bench/swap_product.py --out $OUT

Per shape: the swapped configs tuning "fast" offers (tuning/space.swapped_configs, an H100's split), each checked
against float64 and timed as the tuner times (tuning.choose._bench), then the probe's best swapped config of the
same tile. Epilogue relu(acc + bias). JSON to $OUT/swap_product.json.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import swap_ab  # noqa: E402
from resfuse import kernels  # noqa: E402
from resfuse.ops.fused import Output  # noqa: E402
from resfuse.tuning import space  # noqa: E402
from resfuse.tuning.choose import Call, _bench  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    rows = []
    for (m, k, n), cached in swap_ab.SHAPES.items():
        hw = int(m ** 0.5)
        cl, h = torch.channels_last, torch.float16
        x = torch.randn(1, k, hw, hw, device="cuda", dtype=h).contiguous(memory_format=cl)
        w = torch.randn(n, k, 1, 1, device="cuda", dtype=h) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=h)
        out = torch.empty(1, n, hw, hw, device="cuda", dtype=h).contiguous(memory_format=cl)
        want = torch.relu(F.conv2d(x.double(), w.double()) + bias.double()[:, None, None])
        call = Call("conv2d", (x, w), [bias], "relu(add(acc,c0))", ([1, 1], [0, 0], [1, 1]), Output.like(out))
        for cfg in [c for c in space.configs(call, "fast") if c.swap]:
            out.fill_(float("nan"))

            def run(cfg=cfg):
                kernels.conv2d(x, w, [bias], "relu(add(acc,c0))", [1, 1], [0, 0], [1, 1], out, cfg)
            run()
            err = ((out.double() - want).norm() / want.norm()).item()
            us = _bench(run) * 1e6
            xm, wm = x.permute(0, 2, 3, 1).reshape(m, k), w.reshape(n, k)
            probe_out = torch.empty(m, n, device="cuda", dtype=torch.float16)
            probe = swap_ab.launcher(xm, wm, bias, probe_out, True, cfg.block_m, cfg.block_n, 64, cfg.split_k)
            probe()
            rows.append({"shape": [m, k, n], "tile": [cfg.block_m, cfg.block_n], "split": cfg.split_k, "us": us,
                         "rel_err": err, "probe_us": _bench(probe) * 1e6, "tuner_best_us": cached})
            r = rows[-1]
            print(f"{(m, k, n)} {cfg.block_m}x{cfg.block_n} split {cfg.split_k}: resfuse {us:.2f} us (err {err:.1e}), "
                  f"probe {r['probe_us']:.2f}, tuner's best before {cached:.2f}", flush=True)
        with open(os.path.join(args.out, "swap_product.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
