"""How far one conv + inference batch norm lands from the exact answer in fp16, three ways (CPU, seconds).

Entry point: `python bench/fold_rounding.py`. Thirty-ninth session, on RegNetY's error against eager (6.3e-4,
torch.compile's 1.1e-4): does folding the batch norm into an fp16 weight, as our cuDNN path does, make a layer
worse than eager? For batch-norm scales spread over 1x, 4x and 20x, each mean relative error against float64:
- eager: the conv's result rounded to fp16, then the batch norm, rounded again;
- fold: the scale folded into the weight, the weight rounded to fp16, the shift added, rounded once;
- fused: the conv and the batch norm in one fp32 epilogue, rounded once.
Printed: 2.5/2.1/2.1e-4 at 1x, 2.6/2.6/2.1e-4 at 4x, 2.7/2.7/2.1e-4 at 20x.

Forty-first session (`--pooled`): the same layer on a post-ReLU input (non-negative, as every conv after the stem
reads), and each output also averaged over the image, as a classifier's global pool does. The folded weight's
rounding is a fixed error per weight: on an input with a mean, it leaves each output channel a constant offset,
which the pool keeps, where the per-value roundings of eager's outputs average out.
"""
import argparse

import torch
import torch.nn.functional as F


def r16(t: torch.Tensor) -> torch.Tensor:
    return t.half().double()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pooled", action="store_true", help="post-ReLU inputs; errors of the outputs' image means too")
    args = p.parse_args()
    torch.manual_seed(0)
    for spread in (1.0, 4.0, 20.0):
        errs = {"eager": [], "fold": [], "fused": []}
        pooled = {k: [] for k in errs}
        for _ in range(5):
            x, w = r16(torch.randn(4, 64, 16, 16)), r16(torch.randn(64, 64, 3, 3) / 24)
            if args.pooled:
                x = x.clamp_min(0)
            scale = torch.exp(torch.empty(64).uniform_(-1, 1) * torch.log(torch.tensor(spread))).double()
            mean, shift = torch.randn(64).double() * 0.5, torch.randn(64).double()
            acc = F.conv2d(x, w, padding=1)  # fp16 values, accumulated exactly
            truth = (acc - mean[:, None, None]) * scale[:, None, None] + shift[:, None, None]
            outs = {
                "eager": r16((r16(acc) - mean[:, None, None]) * scale[:, None, None] + shift[:, None, None]),
                "fold": r16(F.conv2d(x, r16(w * scale[:, None, None, None]), padding=1)
                            + (shift - mean * scale)[:, None, None]),
                "fused": r16(truth),
            }
            for k, v in outs.items():
                errs[k].append(((v - truth).norm() / truth.norm()).item())
                pool, pool_truth = v.mean(dim=(2, 3)), truth.mean(dim=(2, 3))
                pooled[k].append(((pool - pool_truth).norm() / pool_truth.norm()).item())
        print(f"batch-norm scales spread x{spread}: "
              + "  ".join(f"{k} {sum(v) / len(v):.2e}" for k, v in errs.items())
              + ("  | pooled: " + "  ".join(f"{k} {sum(v) / len(v):.2e}" for k, v in pooled.items())
                 if args.pooled else ""))


if __name__ == "__main__":
    main()
