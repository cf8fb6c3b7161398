"""The shortcut kernel (kernels/shortcut.py) under the interpreter: a 1x1 conv whose residual is another 1x1 conv
(any stride, x in any layout), computed in the same kernel; random epilogues on both, pixel and channel counts that
are not multiples of the tiles, bulk or per-thread stores; and its refusals."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse.epilogue import Op, Operand
from resfuse.kernels import shortcut

from .epilogues import assert_close, make_operand, reference, trees


def _nhwc(shape, dtype):
    return torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last)


def _operands(data, roles, out_shape, dtype):
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    return [make_operand(role, kind, out_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]


def _main_tree(data):
    """A random epilogue, then the residual added (or subtracted) as a full operand, maybe a relu after: the
    form FuseAddToOutput leaves on a block's last conv. Returns (tree, roles, the residual's slot)."""
    tree, roles = data.draw(trees())
    slot = len(roles)
    residual = Operand(slot, "full")
    name, swap = data.draw(st.sampled_from(["add", "sub"])), data.draw(st.booleans())
    tree = Op(name, (residual, tree) if swap else (tree, residual))
    if data.draw(st.booleans()):
        tree = Op("relu", (tree,))
    return tree, roles, slot


def _check(y, w1, ops1, tree1, slot, x, w2, ops2, tree2, stride, z, dtype):
    r3 = reference(F.conv2d(x.double(), w2.double(), stride=stride), tree2, ops2, 1)
    r = r3.to(dtype).double().reshape(z.shape[0], z.shape[2], z.shape[3], z.shape[1]).permute(0, 3, 1, 2)
    ref = reference(F.conv2d(y.double(), w1.double()), tree1, [*ops1[:slot], r, *ops1[slot:]], 1)
    # the kernel rounds its own fp32 r, which may land one ulp from the rounded float64 one; that ulp passes
    # through the add (and a relu) unscaled, and is large next to a z that cancels r
    assert_close(epi.rows3(z, z.shape, 1), ref, dtype, slack=torch.finfo(dtype).eps * r3.abs())


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), n=st.integers(1, 2),
       oh=st.integers(1, 4), ow=st.integers(1, 5), stride=st.sampled_from([1, 2]), k1=st.sampled_from([16, 40]),
       k2=st.sampled_from([8, 32]), c=st.sampled_from([16, 24, 40]), x_layout=st.sampled_from(["nhwc", "nchw"]),
       block=st.sampled_from([(16, 16, 16), (32, 16, 32)]), tma_store=st.booleans())
def test_shortcut_matches_two_convs(data, dtype, n, oh, ow, stride, k1, k2, c, x_layout, block, tma_store):
    tree1, roles1, slot = _main_tree(data)
    tree2, roles2 = data.draw(trees())
    y = _nhwc([n, k1, oh, ow], dtype)
    x = torch.randn(n, k2, oh * stride - data.draw(st.integers(0, stride - 1)), ow * stride).to(dtype)
    if x_layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    w1 = (torch.randn(c, k1, 1, 1) / k1 ** 0.5).to(dtype)
    w2 = (torch.randn(c, k2, 1, 1) / k2 ** 0.5).to(dtype)
    ops1 = _operands(data, roles1, [n, c, oh, ow], dtype)
    ops2 = _operands(data, roles2, [n, c, oh, ow], dtype)
    z = torch.full([n, c, oh, ow], float("nan"), dtype=dtype).contiguous(memory_format=torch.channels_last)
    bm, bn, bk = block
    cfg = shortcut.ShortcutConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=2, tma_store=tma_store)
    shortcut.conv2d_shortcut(y, w1, ops1, str(tree1), slot, x, w2, ops2, str(tree2), [stride, stride], z, cfg)
    _check(y, w1, ops1, tree1, slot, x, w2, ops2, tree2, (stride, stride), z, dtype)


def test_shortcut_resnet_downsample_default_config():
    """A downsampling bottleneck's end: relu(bn(conv(y)) + bn(conv(x, stride 2))), the heuristic config, 5x5
    output pixels from a 10x10 x (50 rows against 32-row blocks), 48 channels against 32-channel ones."""
    dtype = torch.float16
    y, x = _nhwc([2, 16, 5, 5], dtype), _nhwc([2, 32, 10, 10], dtype)
    w1 = (torch.randn(48, 16, 1, 1) / 4).to(dtype)
    w2 = (torch.randn(48, 32, 1, 1) / 6).to(dtype)
    bn1 = [torch.randn(48), torch.rand(48) + 0.5, torch.randn(48), torch.randn(48)]
    bn2 = [torch.randn(48), torch.rand(48) + 0.5, torch.randn(48), torch.randn(48)]
    sig1, sig2 = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))", "bn[#1e-05](acc,c0,c1,c2,c3)"
    z = torch.full([2, 48, 5, 5], float("nan"), dtype=dtype).contiguous(memory_format=torch.channels_last)
    shortcut.conv2d_shortcut(y, w1, bn1, sig1, 4, x, w2, bn2, sig2, [2, 2], z)

    def bn(t, m, v, g, b):
        return (t - m[:, None, None]) / torch.sqrt(v[:, None, None] + 1e-5) * g[:, None, None] + b[:, None, None]
    r = bn(F.conv2d(x.double(), w2.double(), stride=2), *map(torch.Tensor.double, bn2)).half().double()
    ref = torch.relu(bn(F.conv2d(y.double(), w1.double()), *map(torch.Tensor.double, bn1)) + r)
    assert_close(z.double(), ref, dtype)


@pytest.mark.parametrize("case, reason", [
    ("fp32", "fp16/bf16"), ("3x3", "two 1x1 convs"), ("grouped", "grouped"), ("channels", "output channels differ"),
    ("k=12", "multiples of 8"), ("shape", "not shaped like"), ("contiguous", "channels_last"),
])
def test_shortcut_refusals(case, reason):
    dtype = torch.float32 if case == "fp32" else torch.float16
    k1 = 12 if case == "k=12" else 16
    y = torch.randn(2, k1, 4, 4, dtype=dtype)
    if case != "contiguous":
        y = y.contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 32, 8 if case != "shape" else 6, 8, dtype=dtype)
    w1 = torch.randn(32, k1 // 2 if case == "grouped" else k1, *((3, 3) if case == "3x3" else (1, 1)), dtype=dtype)
    w2 = torch.randn(16 if case == "channels" else 32, 32, 1, 1, dtype=dtype)
    assert reason in shortcut.refusal(y, w1, x, w2, [2, 2])
    z = torch.empty(2, 32, 4, 4, dtype=dtype).contiguous(memory_format=torch.channels_last)
    with pytest.raises(NotImplementedError, match=reason):
        shortcut.conv2d_shortcut(y, w1, [], "add(acc,full0)", 0, x, w2, [], "acc", [2, 2], z)


def test_shortcut_config_check():
    p = shortcut.ShortcutProblem(m=1568, k1=512, k2=1024, n=2048, dtype_bytes=2, sms=132)
    assert shortcut.default_config(p).check(p)
    assert not shortcut.ShortcutConfig(block_m=256, block_n=256, num_warps=8).check(p)  # registers
    assert not shortcut.ShortcutConfig(block_m=128, block_n=128, num_warps=4).check(p)
    narrow = shortcut.ShortcutProblem(100352, 64, 64, 64, 2, 132)
    assert shortcut.default_config(narrow).block_n == 64
    folds = dataclasses.replace(p, foldable=True)  # an op of one form gets that form's configs alone
    assert shortcut.default_config(folds).fold and shortcut.default_config(folds).check(folds)
    assert not shortcut.default_config(p).check(folds) and not shortcut.default_config(folds).check(p)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), n=st.integers(1, 2),
       oh=st.integers(1, 4), ow=st.integers(1, 5), stride=st.sampled_from([1, 2]), k1=st.sampled_from([16, 40]),
       k2=st.sampled_from([8, 32]), c=st.sampled_from([16, 24]), tma_store=st.booleans())
def test_sum_form_matches_the_two_convs_summed(data, dtype, n, oh, ow, stride, k1, k2, c, tma_store):
    """Without a second epilogue (slot and signature2 None): one accumulator for both reductions, then the epilogue."""
    tree, roles = data.draw(trees())
    y = _nhwc([n, k1, oh, ow], dtype)
    x = torch.randn(n, k2, oh * stride, ow * stride).to(dtype).contiguous(memory_format=torch.channels_last)
    w1 = (torch.randn(c, k1, 1, 1) / k1 ** 0.5).to(dtype)
    w2 = (torch.randn(c, k2, 1, 1) / k2 ** 0.5).to(dtype)
    ops = _operands(data, roles, [n, c, oh, ow], dtype)
    z = torch.full([n, c, oh, ow], float("nan"), dtype=dtype).contiguous(memory_format=torch.channels_last)
    cfg = shortcut.ShortcutConfig(32, 16, 16, 8, 4, 2, tma_store=tma_store)
    shortcut.conv2d_shortcut(y, w1, ops, str(tree), None, x, w2, [], None, [stride, stride], z, cfg)
    acc = F.conv2d(y.double(), w1.double()) + F.conv2d(x.double(), w2.double(), stride=stride)
    assert_close(epi.rows3(z, z.shape, 1), reference(acc, tree, ops, 1), dtype)
