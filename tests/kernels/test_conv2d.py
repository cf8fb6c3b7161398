"""Conv2d fprop kernel numerics under the interpreter: epilogues, stride/padding/dilation, layouts, split-K."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse.kernels import launch
from resfuse.ops.fused import conv_out_shape

from .epilogues import assert_close, forced_split, make_operand, reference, trees, with_layout

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_conv(x, w, tree, operands, stride, padding, dilation, out_layout=torch.contiguous_format):
    shape = conv_out_shape(x, w, stride, padding, dilation)
    out = torch.full(shape, float("nan"), dtype=x.dtype).contiguous(memory_format=out_layout)
    return launch.conv2d(x, w, operands, str(tree), list(stride), list(padding), list(dilation), out)



@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 2), c=st.sampled_from([1, 3, 5, 16, 20, 37]),
       k=st.integers(1, 40), hw=st.tuples(st.integers(1, 9), st.integers(1, 9)), rs=st.sampled_from([1, 2, 3, 5]),
       stride=st.sampled_from([1, 2, 3]), padding=st.sampled_from([0, 1, 2]), dilation=st.sampled_from([1, 2]),
       x_layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
       w_layout=st.sampled_from(["contiguous", "channels_last"]), split=st.sampled_from([1, 1, 2, 3, 5]))
def test_conv2d_epilogues(data, dtype, n, c, k, hw, rs, stride, padding, dilation, x_layout, w_layout, split):
    h, w_ = hw
    assume(min(h, w_) + 2 * padding - dilation * (rs - 1) - 1 >= 0)  # at least one output pixel
    tree, roles = data.draw(trees())
    x = with_layout(torch.randn(n, c, h, w_).to(dtype), x_layout)
    w = with_layout((torch.randn(k, c, rs, rs) / (c * rs * rs) ** 0.5).to(dtype), w_layout)
    out_shape = conv_out_shape(x, w, (stride,) * 2, (padding,) * 2, (dilation,) * 2)
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, out_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    out_layout = torch.channels_last if x_layout == "channels_last" else torch.contiguous_format
    with forced_split(split):
        out = run_conv(x, w, tree, operands, (stride,) * 2, (padding,) * 2, (dilation,) * 2, out_layout)
    acc = F.conv2d(x.double(), w.double(), None, stride, padding, dilation)
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, tree, operands, 1), dtype)


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
