"""The pre-aot attention-mask pass: HF's stride-0 bidirectional mask no longer sends SDPA to fp32 math.

On CPU the flash kernel takes such masks anyway, so these tests check the rewrite and the values; the GPU
effect (math SDPA -> cuDNN attention) is measured by bench/sdpa_probe.py and `resfuse bench hf-bert-base`.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd

from resfuse.passes.attention_mask import contiguous_attention_masks, drop_all_true_masks
from resfuse.passes.report import Report


class Attention(torch.nn.Module):
    def __init__(self, contiguous: bool):
        super().__init__()
        self.contiguous = contiguous

    def forward(self, q, k, v, keep):
        # the mask HF transformers builds under torch.compile: a bool expand whose last dim has stride 0
        mask = keep[:, None, :, None].expand(q.shape[0], 1, q.shape[2], k.shape[2])
        mask = mask.contiguous() if self.contiguous else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2 + F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask)


def _compiled(module, inputs):
    """The masks the SDPA calls get after both passes (nodes, or None where dropped), the report, the output."""
    masks, report = [], Report()
    lower = aot_autograd(fw_compiler=lambda gm, _: gm, inference_compiler=lambda gm, _: gm)

    def backend(gm, example_inputs):
        gm = contiguous_attention_masks(drop_all_true_masks(gm, report), report)
        masks.extend(n.kwargs.get("attn_mask") for n in gm.graph.nodes
                     if n.op == "call_function" and "scaled_dot_product" in str(n.target))
        return lower(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(module, backend=backend)(*inputs)
    return masks, report, out


def _masks_seen(contiguous: bool, inputs):
    """The last-dim strides of the masks the SDPA calls get, after the passes, and the passes' report."""
    masks, report, out = _compiled(Attention(contiguous), inputs)
    return [m.meta["example_value"].stride(-1) for m in masks], report, out


def test_stride0_mask_is_made_contiguous_once_and_keeps_the_values():
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    keep = torch.rand(2, 7) > 0.3
    keep[:, 0] = True  # no fully masked row
    strides, report, out = _masks_seen(False, (q, k, v, keep))
    assert strides == [1, 1]
    assert len(report.rewrites) == 1 and "stride 0" in report.rewrites[0]  # one copy, shared by both calls
    torch.testing.assert_close(out, Attention(False)(q, k, v, keep), rtol=1e-5, atol=1e-5)


def test_a_contiguous_mask_is_left_alone():
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    strides, report, _ = _masks_seen(True, (q, k, v, torch.rand(2, 7) > 0.3))
    assert strides == [1, 1] and report.rewrites == []


class ConstantMask(torch.nn.Module):
    """The mask transformers 5.17 builds under torch.compile when the caller gives none: every query sees every
    key, computed from constants. `causal` builds a constant mask that does hide keys, which must stay."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v):
        b, _, s, _ = q.shape
        pos = torch.arange(s, device=q.device)
        if self.kind == "all-true":
            mask = (pos[None, None, :, None] + 0 >= 0).expand(b, -1, s, s)
        elif self.kind == "zero-bias":
            mask = torch.zeros(1, 1, s, s, device=q.device, dtype=q.dtype).expand(b, 1, s, s)
        else:
            mask = (pos[None, None, :, None] >= pos[None, None, None, :]).expand(b, 1, s, s)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) + F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind", ["all-true", "zero-bias"])
def test_a_mask_from_constants_that_hides_nothing_is_dropped(kind):
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    masks, report, out = _compiled(ConstantMask(kind), (q, k, v))
    assert masks == [None, None]
    assert sum("dropped" in r for r in report.rewrites) == 1  # one verdict for the mask both calls share
    torch.testing.assert_close(out, ConstantMask(kind)(q, k, v), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, 2 * F.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_a_constant_mask_that_hides_keys_is_kept():
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    masks, report, out = _compiled(ConstantMask("causal"), (q, k, v))
    assert all(m is not None for m in masks) and not any("dropped" in r for r in report.rewrites)
    torch.testing.assert_close(out, ConstantMask("causal")(q, k, v), rtol=1e-5, atol=1e-5)


def test_a_mask_from_an_input_is_kept_even_when_all_true():
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    strides, report, _ = _masks_seen(False, (q, k, v, torch.ones(2, 7, dtype=torch.bool)))
    assert strides == [1, 1] and not any("dropped" in r for r in report.rewrites)
