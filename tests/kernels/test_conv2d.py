"""Conv2d fprop kernel numerics under the interpreter: epilogues, stride/padding/dilation, layouts, split-K."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse.kernels import codegen, launch
from resfuse.ops.fused import conv_out_shape

from .epilogues import (assert_close, check_aux, descriptor_slots, forced_split, make_operand, output_descriptor,
                        poisoned_aux, reference,
                        trees, with_layout)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_conv(x, w, tree, operands, stride, padding, dilation, out_layout=torch.contiguous_format, aux=None):
    shape = conv_out_shape(x, w, stride, padding, dilation)
    out = torch.full(shape, float("nan"), dtype=x.dtype).contiguous(memory_format=out_layout)
    return launch.conv2d(x, w, operands, str(tree), list(stride), list(padding), list(dilation), out, aux=aux)



@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 2), c=st.sampled_from([1, 3, 5, 16, 20, 37]),
       k=st.integers(1, 40), hw=st.tuples(st.integers(1, 9), st.integers(1, 9)), rs=st.sampled_from([1, 2, 3, 5]),
       stride=st.sampled_from([1, 2, 3]), padding=st.sampled_from([0, 1, 2]), dilation=st.sampled_from([1, 2]),
       x_layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
       w_layout=st.sampled_from(["contiguous", "channels_last"]), split=st.sampled_from([1, 1, 2, 3, 5]))
def test_conv2d_epilogues(data, dtype, n, c, k, hw, rs, stride, padding, dilation, x_layout, w_layout, split):
    h, w_ = hw
    assume(min(h, w_) + 2 * padding - dilation * (rs - 1) - 1 >= 0)  # at least one output pixel
    tree, roles = data.draw(trees(aux=True))
    x = with_layout(torch.randn(n, c, h, w_).to(dtype), x_layout)
    w = with_layout((torch.randn(k, c, rs, rs) / (c * rs * rs) ** 0.5).to(dtype), w_layout)
    out_shape = conv_out_shape(x, w, (stride,) * 2, (padding,) * 2, (dilation,) * 2)
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, out_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    out_layout = torch.channels_last if x_layout == "channels_last" else torch.contiguous_format
    aux = poisoned_aux(tree, torch.empty(out_shape, dtype=dtype).contiguous(memory_format=out_layout))
    with forced_split(split):
        out = run_conv(x, w, tree, operands, (stride,) * 2, (padding,) * 2, (dilation,) * 2, out_layout, aux)
    acc = F.conv2d(x.double(), w.double(), None, stride, padding, dilation)
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, tree, operands, 1), dtype)
    check_aux(aux, acc, tree, operands, 1, dtype)


@pytest.mark.parametrize("signature", [
    "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))",  # the ResNet bottleneck tail
    "mul(gelu(add(acc,c0)),full1)",  # a nonlinearity before a mul: what serial split-K gets wrong
    "sub(full1,clamp[#0.0,#6.0](add(acc,c0)))",
])
@pytest.mark.parametrize("split", [1, 3])
def test_conv2d_resnet_like_tails(signature, split):
    x = torch.randn(2, 24, 7, 7).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(40, 24, 3, 3) / 15).contiguous(memory_format=torch.channels_last)
    tree = epi.parse(signature)
    out_shape = conv_out_shape(x, w, (1, 1), (1, 1), (1, 1))
    roles = {o.slot: o.kind for o in epi.operands(tree)}
    operands = [make_operand("positive" if s == 1 else "any", roles[s], out_shape, 1, x.dtype, 1)
                for s in sorted(roles)]
    with forced_split(split):
        out = run_conv(x, w, tree, operands, (1, 1), (1, 1), (1, 1), torch.channels_last)
    acc = F.conv2d(x.double(), w.double(), None, 1, 1, 1)
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, tree, operands, 1), torch.float32)


def test_conv2d_rgb_stem_7x7_stride2():
    x = torch.randn(1, 3, 20, 20).half().contiguous(memory_format=torch.channels_last)
    w = (torch.randn(16, 3, 7, 7) / 12).half().contiguous(memory_format=torch.channels_last)
    bias = torch.randn(16, 1, 1).half()
    out = run_conv(x, w, "relu(add(acc,c0))", [bias], (2, 2), (3, 3), (1, 1), torch.channels_last)
    acc = F.conv2d(x.double(), w.double(), None, 2, 3, 1)
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, epi.parse("relu(add(acc,c0))"), [bias], 1),
                 torch.float16)


def test_conv2d_rejects_groups():
    x, w = torch.randn(1, 4, 5, 5), torch.randn(4, 2, 3, 3)
    with pytest.raises(NotImplementedError):
        launch.conv2d(x, w, [], "acc", [1, 1], [1, 1], [1, 1], torch.empty(1, 4, 5, 5))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 3), c8=st.integers(1, 5),
       k=st.integers(1, 40), hw=st.tuples(st.integers(1, 9), st.integers(1, 9)),
       out_layout=st.sampled_from([torch.channels_last, torch.contiguous_format]), split=st.sampled_from([1, 2, 3]),
       tile=st.sampled_from([(16, 16, 16), (32, 16, 32), (16, 32, 16)]), persistent=st.sampled_from([0, 1, 2]))
def test_1x1_conv_on_the_tma_mainloop(data, dtype, n, c8, k, hw, out_layout, split, tile, persistent):
    """A 1x1 stride-1 conv on a channels_last input is the GEMM [N*H*W, C] @ [C, K]; with tma=True it runs the
    TMA-descriptor mainloop, epilogue rows indexed per sample, into either output layout; persistent > 0, the
    persistent GEMM kernel, whose programs walk the tiles."""
    c = 8 * c8  # 16-byte rows for every dtype
    tree, roles = data.draw(trees())
    x = torch.randn(n, c, *hw).to(dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(k, c, 1, 1) / c ** 0.5).to(dtype)
    out_shape = [n, k, *hw]
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, out_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    out = torch.full(out_shape, float("nan"), dtype=dtype).contiguous(memory_format=out_layout)
    assert launch.conv_as_gemm(x, w, [1, 1], [0, 0], out.stride()) is not None  # the TMA path, not the fallback
    bulk = data.draw(st.booleans()) and (persistent or split == 1)  # a bulk output store
    cfg = launch.ConvConfig(*tile, group_m=2, split_k=1 if persistent else split, num_warps=4, num_stages=2, tma=True,
                            persistent=persistent, tma_store=bulk)
    launch.conv2d(x, w, operands, str(tree), [1, 1], [0, 0], [1, 1], out, cfg)
    family = "gemm_tma_persistent" if persistent else "gemm_tma"
    slots = descriptor_slots(tree, operands, out_shape, 1, cfg.split_k)
    out_tma = output_descriptor(out, 1, cfg.split_k) and cfg.tma_store
    assert (family, codegen.variant(str(tree), slots, out_tma)) in codegen._LOADED  # not the fallback
    acc = F.conv2d(x.double(), w.double())
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, tree, operands, 1), dtype)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), c=st.integers(1, 40), k=st.integers(1, 40),
       hw=st.tuples(st.integers(1, 9), st.integers(1, 9)), split=st.sampled_from([1, 2, 3]),
       out_layout=st.sampled_from([torch.channels_last, torch.contiguous_format]),
       tile=st.sampled_from([(32, 16, 16), (16, 32, 16), (16, 16, 32)]))
def test_swapped_1x1_conv_of_one_image(data, dtype, c, k, hw, split, out_layout, tile):
    """ConvConfig.swap: a 1x1 stride-1 conv of one channels_last image as the transposed GEMM, the output channels
    along the tile's rows; every epilogue against float64, into either output layout."""
    tree, roles = data.draw(trees(aux=True))
    x = torch.randn(1, c, *hw).to(dtype).contiguous(memory_format=torch.channels_last)
    w = with_layout((torch.randn(k, c, 1, 1) / c ** 0.5).to(dtype), data.draw(st.sampled_from(
        ["contiguous", "channels_last"])))
    out_shape = [1, k, *hw]
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, out_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    aux = poisoned_aux(tree, torch.empty(out_shape, dtype=dtype).contiguous(memory_format=out_layout))
    out = torch.full(out_shape, float("nan"), dtype=dtype).contiguous(memory_format=out_layout)
    cfg = launch.ConvConfig(*tile, group_m=2, split_k=split, num_warps=4, num_stages=2, swap=True)
    launch.conv2d(x, w, operands, str(tree), [1, 1], [0, 0], [1, 1], out, cfg, aux=aux)
    assert ("gemm", codegen.variant(str(tree), swap=True)) in codegen._LOADED
    acc = F.conv2d(x.double(), w.double())
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, tree, operands, 1), dtype)
    check_aux(aux, acc, tree, operands, 1, dtype)


def test_a_swapped_conv_config_takes_one_image_and_a_plain_gemm_only():
    cfg = launch.ConvConfig(16, 16, 16, 2, 1, False, 4, 2, swap=True)
    cl = torch.channels_last
    for x, w, padding in ((torch.randn(2, 8, 5, 5).contiguous(memory_format=cl), torch.randn(6, 8, 1, 1), 0),
                          (torch.randn(1, 8, 5, 5).contiguous(memory_format=cl), torch.randn(6, 8, 3, 3), 1),
                          (torch.randn(1, 8, 5, 5), torch.randn(6, 8, 1, 1), 0)):  # two images, 3x3, NCHW input
        out = torch.empty(x.shape[0], 6, 5, 5).contiguous(memory_format=cl)
        with pytest.raises(NotImplementedError):
            launch.conv2d(x, w, [], "acc", [1, 1], [padding] * 2, [1, 1], out, cfg)
    problem = launch.ConvProblem(1, 8, 6, 1, 1, 5, 5, 4, 1)
    assert cfg.check(problem) and not cfg.check(dataclasses.replace(problem, n=2))
    assert not cfg.check(dataclasses.replace(problem, r=3, s=3))


def test_tma_conv_config_falls_back_where_the_conv_is_no_plain_gemm():
    x = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    w = torch.randn(6, 8, 3, 3)
    cl = torch.empty(2, 6, 5, 5).contiguous(memory_format=torch.channels_last).stride()
    assert launch.conv_as_gemm(x, w, [1, 1], [1, 1], cl) is None
    assert launch.conv_as_gemm(x.contiguous(), torch.randn(6, 8, 1, 1), [1, 1], [0, 0], cl) is None  # NCHW input
    out = run_conv(x, w, epi.parse("relu(acc)"), [], (1, 1), (1, 1), (1, 1))
    cfg = launch.ConvConfig(16, 16, 16, 2, 1, False, 4, 2, tma=True)
    tma_out = torch.full_like(out, float("nan"))
    launch.conv2d(x, w, [], "relu(acc)", [1, 1], [1, 1], [1, 1], tma_out, cfg)
    torch.testing.assert_close(tma_out, out)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 3), c8=st.integers(1, 3),
       k=st.integers(1, 40), hw=st.tuples(st.integers(1, 9), st.integers(1, 9)), rs=st.sampled_from([1, 2, 3, 5]),
       padding=st.sampled_from([0, 1, 2]), dilation=st.sampled_from([1, 2]), split=st.sampled_from([1, 2, 3]),
       tile=st.sampled_from([(16, 16, 8), (32, 16, 16), (64, 32, 8), (16, 32, 16)]))
def test_tma_conv_mainloop_epilogues(data, dtype, n, c8, k, hw, rs, padding, dilation, split, tile):
    """Stride-1 channels_last convs on the TMA mainloop: boxes of output pixels (several images per box when the
    image is small) whose shifted input boxes read the padding, negative coordinates included, as zeros."""
    h, w_ = hw
    assume(min(h, w_) + 2 * padding - dilation * (rs - 1) - 1 >= 0)
    c = 8 * c8
    tree, roles = data.draw(trees(aux=True))
    x = with_layout(torch.randn(n, c, h, w_).to(dtype), "channels_last")
    w = with_layout((torch.randn(k, c, rs, rs) / (c * rs * rs) ** 0.5).to(dtype), "channels_last")
    assert launch.conv_tma_operands(x, w, (1, 1)) is not None
    out_shape = conv_out_shape(x, w, (1, 1), (padding,) * 2, (dilation,) * 2)
    operands = [make_operand(role, kind, out_shape, 1, dtype, 1) for kind, role in roles]
    out = torch.full(out_shape, float("nan"), dtype=dtype).contiguous(memory_format=torch.channels_last)
    aux = poisoned_aux(tree, out)
    cfg = launch.ConvConfig(*tile, group_m=2, split_k=split, num_warps=4, num_stages=2, tma=True,
                            ws=data.draw(st.booleans()))
    launch.conv2d(x, w, operands, str(tree), [1, 1], [padding] * 2, [dilation] * 2, out, cfg, aux)
    acc = F.conv2d(x.double(), w.double(), None, 1, padding, dilation)
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, tree, operands, 1), dtype)
    check_aux(aux, acc, tree, operands, 1, dtype)


def test_tma_conv_needs_stride_1_channels_last_and_aligned_channels():
    cl = torch.channels_last
    x, w = torch.randn(1, 8, 5, 5).to(memory_format=cl), torch.randn(4, 8, 3, 3).to(memory_format=cl)
    assert launch.conv_tma_operands(x, w, (1, 1)) is not None
    assert launch.conv_tma_operands(x, w, (2, 2)) is None
    assert launch.conv_tma_operands(x.contiguous(), w, (1, 1)) is None
    assert launch.conv_tma_operands(x[:, :6], w[:, :6], (1, 1)) is None  # 24-byte fp32 rows
    # a TMA config where the descriptors cannot read runs the pointer mainloop, with the same result
    cfg = launch.ConvConfig(16, 16, 8, 2, 1, False, 4, 2, True)
    out = torch.full((1, 4, 3, 3), float("nan"))
    launch.conv2d(x.contiguous(), w, [], "acc", [1, 1], [0, 0], [1, 1], out, cfg)
    torch.testing.assert_close(out, F.conv2d(x, w), rtol=1e-5, atol=1e-5)


def test_tma_box_wastes_the_fewest_pixels():
    from resfuse.kernels.conv2d_fprop import tma_box

    assert tma_box(128, 32, 56, 56) == (8, 8)  # two images' 8 x 8 boxes: 56 = 7 x 8, nothing wasted
    assert tma_box(128, 32, 28, 28) == (4, 32)  # 28 = 7 x 4 rows; 32 columns waste 4 of 32
    assert tma_box(128, 32, 7, 7) == (8, 8)  # two images per box, 49 of 64 pixels each
