"""Which attention kernel HF BERT's SDPA call gets under torch.compile, and why (GPU machine).

Entry point: `python bench/sdpa_probe.py`. Prints the scaled_dot_product_attention calls of the dynamo
graph with their arguments' metadata, then asks torch._fused_sdp_choice about real tensors made alike.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from resfuse.bench import models  # noqa: E402

NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def meta(v):
    if isinstance(v, torch.fx.Node):
        v = v.meta.get("example_value")
    if isinstance(v, torch.Tensor):
        return f"T{tuple(v.shape)} s{v.stride()} {v.dtype}"
    return repr(v)


def like(v):
    v = v.meta["example_value"] if isinstance(v, torch.fx.Node) else v
    if not isinstance(v, torch.Tensor):
        return v
    base = torch.zeros(v.untyped_storage().nbytes() // v.element_size() + 1, dtype=v.dtype, device=v.device)
    return base.as_strided(v.shape, v.stride(), v.storage_offset())


def main():
    model, inputs = models.load("hf-bert-base", 32, torch.float16, torch.device("cuda"), seq=384)
    calls = []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if "scaled_dot_product" in str(n.target):
                calls.append(n)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=backend)(*inputs)
    for n in calls[:1]:
        print(n.target, [meta(a) for a in n.args], {k: meta(v) for k, v in n.kwargs.items()})
        args = [like(a) for a in n.args]
        kwargs = {k: like(v) for k, v in n.kwargs.items()}
        choice = torch._fused_sdp_choice(*args, attn_mask=kwargs.get("attn_mask"),
                                         dropout_p=kwargs.get("dropout_p", 0.0), is_causal=kwargs.get("is_causal", False),
                                         scale=kwargs.get("scale"))
        print("choice with the trace's tensors:", NAMES.get(choice, choice))
        mask = kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor):
            for name, m in [("mask contiguous", mask.contiguous()), ("mask as fp16", torch.zeros(mask.shape, dtype=torch.float16, device="cuda")), ("no mask", None)]:
                c = torch._fused_sdp_choice(*args, attn_mask=m, dropout_p=0.0, is_causal=False, scale=kwargs.get("scale"))
                print(f"choice with {name}:", NAMES.get(c, c))
    print(f"{len(calls)} sdpa calls")


if __name__ == "__main__":
    main()
