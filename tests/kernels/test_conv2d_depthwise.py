"""Depthwise conv2d kernel numerics under the interpreter: every epilogue op, channel multipliers, non-square
kernels, stride/padding/dilation, layouts, and every config of the fast level; float64 references."""
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse.kernels import launch
from resfuse.kernels.conv2d_depthwise import DepthwiseConfig, default_config, fast_configs, is_depthwise
from resfuse.kernels.conv2d_fprop import ConvProblem
from resfuse.ops.fused import conv_out_shape

from .epilogues import assert_close, check_aux, make_operand, poisoned_aux, reference, trees, with_layout

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TILES = [None, DepthwiseConfig(1, 16, 16, 2), DepthwiseConfig(4, 8, 64, 4), DepthwiseConfig(2, 4, 32, 2),
         DepthwiseConfig(2, 16, 16, 2, strip=8), DepthwiseConfig(4, 8, 32, 1, strip=8),
         DepthwiseConfig(2, 8, 16, 2, strip=4)]


def depthwise(x, w, stride, padding, dilation, tree, operands, config=None, out_layout=torch.channels_last,
              aux=None):
    shape = conv_out_shape(x, w, stride, padding, dilation)
    out = torch.full(shape, float("nan"), dtype=x.dtype).contiguous(memory_format=out_layout)
    return launch.conv2d(x, w, operands, str(tree), list(stride), list(padding), list(dilation), out, config, aux)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 2), c=st.sampled_from([2, 3, 8, 17, 40]),
       mult=st.sampled_from([1, 1, 2]), hw=st.tuples(st.integers(1, 11), st.integers(1, 11)),
       rs=st.tuples(st.sampled_from([1, 3, 5, 7]), st.sampled_from([1, 3, 5])), stride=st.sampled_from([1, 2]),
       padding=st.sampled_from([0, 1, 3]), dilation=st.sampled_from([1, 2]),
       layout=st.sampled_from(["channels_last", "channels_last", "contiguous", "strided"]),
       config=st.sampled_from(TILES))
def test_depthwise_epilogues(data, dtype, n, c, mult, hw, rs, stride, padding, dilation, layout, config):
    (h, w_), (r, s) = hw, rs
    assume(min(h + 2 * padding - dilation * (r - 1), w_ + 2 * padding - dilation * (s - 1)) >= 1)
    tree, roles = data.draw(trees(aux=True))
    x = with_layout(torch.randn(n, c, h, w_).to(dtype), layout)
    w = with_layout((torch.randn(c * mult, 1, r, s) / (r * s) ** 0.5).to(dtype), data.draw(
        st.sampled_from(["contiguous", "channels_last"])))
    assert is_depthwise(x.shape, w.shape)
    out_shape = conv_out_shape(x, w, (stride,) * 2, (padding,) * 2, (dilation,) * 2)
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, out_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    out_layout = torch.contiguous_format if layout == "contiguous" else torch.channels_last
    aux = poisoned_aux(tree, torch.empty(out_shape, dtype=dtype).contiguous(memory_format=out_layout))
    out = depthwise(x, w, (stride,) * 2, (padding,) * 2, (dilation,) * 2, tree, operands, config, out_layout, aux)
    acc = F.conv2d(x.double(), w.double(), None, stride, padding, dilation, groups=c)
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, tree, operands, 1), dtype)
    check_aux(aux, acc, tree, operands, 1, dtype)


CONVNEXT = ConvProblem(2, 40, 40, 7, 7, 9, 11, 2, 1)
STRIDE2 = ConvProblem(2, 40, 40, 7, 7, 5, 6, 2, 1, unit_w=False)


@pytest.mark.parametrize("config", [*fast_configs(default_config(CONVNEXT), CONVNEXT),
                                    *fast_configs(default_config(STRIDE2), STRIDE2)])
def test_every_fast_config_is_correct_on_a_convnext_block(config):
    """ConvNeXt's 7x7 depthwise conv with its bias, channels_last fp16, on a shape no tile divides: the strip
    mainloop's tiles and the per-tap loop's (the fast level's tiles where the strip does not apply)."""
    x = torch.randn(2, 40, 9, 11).half().contiguous(memory_format=torch.channels_last)
    w = (torch.randn(40, 1, 7, 7) / 7).half().contiguous(memory_format=torch.channels_last)
    bias = torch.randn(40).half()
    out = depthwise(x, w, (1, 1), (3, 3), (1, 1), "add(acc,c0)", [bias], config)
    ref = F.conv2d(x.double(), w.double(), bias.double(), 1, 3, 1, groups=40)
    assert_close(out, ref, torch.float16)


def test_mobilenet_tail_stride2_bn_hardswish():
    """MobileNetV3's stride-2 5x5 depthwise conv with its folded batch norm and hardswish."""
    c = 24
    x = torch.randn(1, c, 13, 13).half().contiguous(memory_format=torch.channels_last)
    w = (torch.randn(c, 1, 5, 5) / 5).half().contiguous(memory_format=torch.channels_last)
    mean, var, weight, bias = torch.randn(c), torch.rand(c) + 0.5, torch.randn(c), torch.randn(c)
    signature = "hardswish(bn[#1e-05](acc,c0,c1,c2,c3))"
    out = depthwise(x, w, (2, 2), (2, 2), (1, 1), signature, [mean, var, weight, bias])
    ref = F.hardswish(F.batch_norm(F.conv2d(x.double(), w.double(), None, 2, 2, 1, groups=c), mean.double(),
                                   var.double(), weight.double(), bias.double(), eps=1e-5))
    assert_close(out, ref, torch.float16)


def test_only_depthwise_grouped_convs_take_the_depthwise_kernel():
    x = (1, 8, 5, 5)
    assert is_depthwise(x, (8, 1, 3, 3)) and is_depthwise(x, (16, 1, 3, 3))
    assert not is_depthwise(x, (8, 2, 3, 3))  # groups=4
    assert not is_depthwise((1, 1, 5, 5), (4, 1, 3, 3))  # groups=1: the conv kernel's
    assert not is_depthwise(x, (12, 1, 3, 3))  # 12 outputs from 8 groups is not a conv
    assert not is_depthwise((1, 8, 5), (8, 1, 3))  # 1-D


@pytest.mark.parametrize("unit_w", [True, False])
def test_the_default_passes_its_check_and_the_strip_serves_unit_stride_widths(unit_w):
    for k in (2, 8, 24, 96, 960):
        for n, hw in ((1, 2), (1, 7), (256, 56)):
            for r in (3, 7, 9):
                p = ConvProblem(n, k, k, r, r, hw, hw, 2, 132, unit_w)
                default = default_config(p)
                tiles = fast_configs(default, p)
                strip = unit_w and r <= 7 and hw >= 4
                assert default.check(p) and (default.strip > 0) == strip
                assert len(set(tiles)) == len(tiles)
                if strip and k >= 16:  # the strip tiles that pass their check (32 or 64 channels wide)
                    assert all(c.strip > 0 and c.check(p) for c in tiles)
                if not strip:
                    assert not any(c.strip for c in tiles)
                if not unit_w and k >= 64 and hw > 7:
                    assert all(c.check(p) for c in tiles)  # wide convs keep every per-tap tile


STRIP_TILES = [DepthwiseConfig(2, 16, 16, 2, strip=8), DepthwiseConfig(4, 8, 32, 1, strip=8),
               DepthwiseConfig(2, 8, 16, 2, strip=4), DepthwiseConfig(1, 32, 16, 4, strip=8)]


@settings(max_examples=int(os.environ.get("RESFUSE_EXAMPLES", 15)), deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), c=st.sampled_from([16, 17, 40]), mult=st.sampled_from([1, 2]),
       h=st.integers(1, 6), w_=st.integers(4, 19), r=st.integers(1, 7), s=st.integers(1, 7),
       stride_h=st.sampled_from([1, 2]), dil_h=st.sampled_from([1, 2]),
       pad=st.tuples(st.integers(0, 3), st.integers(0, 3)), config=st.sampled_from(STRIP_TILES))
def test_strip_mainloop(data, dtype, c, mult, h, w_, r, s, stride_h, dil_h, pad, config):
    """The strip mainloop itself, on every width and tap count it takes: checks that it ran (its config passed its
    check, so the launch kept it), any stride and dilation along the height, any epilogue."""
    oh, ow = (h + 2 * pad[0] - dil_h * (r - 1) - 1) // stride_h + 1, w_ + 2 * pad[1] - (s - 1)
    assume(oh >= 1 and ow >= 1)
    p = ConvProblem(1, c, c * mult, r, s, oh, ow, 2, 1)
    assume(config.check(p))
    tree, roles = data.draw(trees(aux=True))
    x = torch.randn(2, c, h, w_).to(dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(c * mult, 1, r, s) / (r * s) ** 0.5).to(dtype).contiguous(memory_format=torch.channels_last)
    stride, padding, dilation = (stride_h, 1), pad, (dil_h, 1)
    out_shape = conv_out_shape(x, w, stride, padding, dilation)
    operands = [make_operand(role, kind, out_shape, 1, dtype, 0) for kind, role in roles]
    aux = poisoned_aux(tree, torch.empty(out_shape, dtype=dtype).contiguous(memory_format=torch.channels_last))
    out = depthwise(x, w, stride, padding, dilation, tree, operands, config, torch.channels_last, aux)
    acc = F.conv2d(x.double(), w.double(), None, stride, padding, dilation, groups=c)
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, tree, operands, 1), dtype)
    check_aux(aux, acc, tree, operands, 1, dtype)


@pytest.mark.parametrize("channels, layout, kv", [(40, torch.channels_last, 8), (20, torch.channels_last, 4),
                                                  (17, torch.channels_last, 1), (40, torch.contiguous_format, 1),
                                                  (64, torch.channels_last, 1)])
def test_channel_vectors_follow_the_channel_count_and_the_output_strides(channels, layout, kv):
    """KV, the channel vector of the mask and of the output's pixel strides: the largest of 8, 4, 2, 1 that divides
    the channel count and the output's sample, row and column strides (NCHW's column stride is 1), or 1 where
    they are all 16-divisible (Triton vectorises those itself); the result is the same whichever it is, over
    channel blocks that end past the last channel (BN = 32)."""
    x = torch.randn(2, channels, 6, 7).contiguous(memory_format=torch.channels_last)
    w = torch.randn(channels, 1, 3, 3)
    bias = torch.randn(channels)
    launch._PLANS.clear()
    out = depthwise(x, w, (1, 1), (1, 1), (1, 1), epi.parse("relu(add(acc,c0))"), [bias],
                    DepthwiseConfig(2, 8, 32, 2, strip=8), layout)
    (plan,) = launch._PLANS.values()
    assert plan.meta["KV"] == kv
    ref = torch.relu(F.conv2d(x.double(), w.double(), bias.double(), padding=1, groups=channels))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
