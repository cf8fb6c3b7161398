"""The image conv (kernels/conv2d_image.py) under the interpreter: a bias-free conv over an image of 1 to 4
channels, every filter size, stride and padding it takes, output channels that are no power of two, against the
float64 conv; with random epilogues, as the tuner's candidate for a fused conv (launch.conv2d with a ConvConfig's
`image`); an inf just past a window stays out of the output; and its refusals."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse.kernels import conv2d_image, launch
from resfuse.kernels.conv2d_fprop import ConvConfig
from resfuse.ops.fused import conv_out_shape

from .epilogues import assert_close, make_operand, reference, trees


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from([torch.float16, torch.bfloat16]), n=st.integers(1, 2), c=st.integers(1, 4),
       h=st.integers(1, 19), w=st.integers(1, 19), k=st.integers(1, 70), r=st.integers(1, 8), s=st.integers(1, 8),
       stride=st.tuples(st.integers(1, 4), st.integers(1, 4)), padding=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       layout=st.sampled_from([torch.channels_last, torch.contiguous_format]), fp32_x=st.booleans(),
       fp32_w=st.booleans())
def test_image_conv_matches_float64(dtype, n, c, h, w, k, r, s, stride, padding, layout, fp32_x, fp32_w):
    """x and w in the conv's dtype, or fp32 (autocast's inputs: the padding kernel casts them). fp32 values that the
    dtype holds exactly: Triton's interpreter casts fp32 to bf16 by truncation, the GPU (and torch) to nearest."""
    if h + 2 * padding[0] < r or w + 2 * padding[1] < s:
        return  # no output pixel
    x = torch.randn(n, c, h, w).to(dtype).to(torch.float32 if fp32_x else dtype).contiguous(memory_format=layout)
    wt = (torch.randn(k, c, r, s) / (c * r * s) ** 0.5).to(dtype).to(torch.float32 if fp32_w else dtype)
    assert conv2d_image.refusal(x, wt, stride, padding, (1, 1), 1, dtype) is None
    ref = F.conv2d(x.double(), wt.double(), None, stride, padding)
    out = torch.full(ref.shape, float("nan"), dtype=dtype).contiguous(memory_format=torch.channels_last)
    conv2d_image.image_conv(x, wt, stride, padding, out)
    assert_close(out.permute(0, 2, 3, 1).reshape(-1, k), ref.permute(0, 2, 3, 1).reshape(-1, k), dtype)


def test_an_inf_past_the_window_stays_out():
    """The kernel reads 8 pixels where a 7-wide window ends: the eighth is zeroed before the dot, not multiplied
    by a zero weight (inf * 0 is NaN)."""
    x = torch.randn(1, 3, 16, 16).half().contiguous(memory_format=torch.channels_last)
    x[0, :, 5, 9] = float("inf")
    wt = torch.rand(16, 3, 7, 7).half() / 100
    out = torch.empty(1, 16, 8, 8).half().contiguous(memory_format=torch.channels_last)
    conv2d_image.image_conv(x, wt, (2, 2), (3, 3), out)
    ref = F.conv2d(x.double(), wt.double(), None, 2, 3)
    assert torch.equal(out.isfinite(), ref.isfinite()) and ref.isfinite().any() and not ref.isfinite().all()
    assert_close(out[ref.isfinite()].reshape(-1, 1), ref[ref.isfinite()].reshape(-1, 1), torch.float16)


@pytest.mark.parametrize("case, why", [
    ("channels", "5 input channels"), ("wide", "at most 8 wide"), ("outputs", "at most 8 wide and 256 outputs"),
    ("fp32", "an fp16/bf16 conv"), ("groups", "groups 1"), ("dilation", "dilation 1")])
def test_refusals(case, why):
    x = torch.randn(1, 5 if case == "channels" else 3, 8, 8, dtype=torch.float32 if case == "fp32" else torch.half)
    wt = torch.randn(300 if case == "outputs" else 8, x.shape[1], 3, 9 if case == "wide" else 3).to(x.dtype)
    got = conv2d_image.refusal(x, wt, (1, 1), (1, 1), (2, 2) if case == "dilation" else (1, 1),
                               3 if case == "groups" else 1)
    assert got is not None and why in got, got


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), c=st.integers(1, 4),
       side=st.integers(3, 17), k=st.integers(1, 40), rs=st.sampled_from([1, 3, 4, 7]), stride=st.integers(1, 3),
       padding=st.integers(0, 3))
def test_image_conv_epilogues_as_the_tuners_candidate(data, dtype, c, side, k, rs, stride, padding):
    if side + 2 * padding < rs:
        return  # no output pixel
    tree, roles = data.draw(trees())
    x = torch.randn(2, c, side, side).to(dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(k, c, rs, rs) / (c * rs * rs) ** 0.5).to(dtype)
    out_shape = conv_out_shape(x, w, (stride,) * 2, (padding,) * 2, (1, 1))
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, out_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    assert conv2d_image.refusal(x, w, (stride,) * 2, (padding,) * 2, (1, 1), 1, dtype, str(tree)) is None
    out = torch.full(out_shape, float("nan"), dtype=dtype).contiguous(memory_format=torch.channels_last)
    launch.conv2d(x, w, operands, str(tree), [stride] * 2, [padding] * 2, [1, 1], out, ConvConfig(image=True))
    acc = F.conv2d(x.double(), w.double(), None, stride, padding)
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, tree, operands, 1), dtype)
