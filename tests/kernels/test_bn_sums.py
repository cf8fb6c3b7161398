"""Batch-norm backward's sums in a producer's epilogue (a bn_stats root) under the interpreter: every kernel
family a conv data gradient runs on (the implicit GEMM with its stride phases and split-K, the GEMM's TMA and
persistent mainloops, the epilogue-only kernel after cuDNN), random epilogues under the root, against float64
sums over the output the kernel stored; and batch_norm_backward given those sums against ATen in float64."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse import kernels
from resfuse.kernels import conv2d_bwd_data, launch

from .epilogues import (assert_close, descriptor_slots, forced_split, make_operand, output_descriptor, reference, trees,
                        with_layout)
from .test_batch_norm_backward import _aten64, _check as _check_bn_backward
from .test_conv2d_dgrad import DTYPES, RESNET, _check, _problem, out_size

pair = st.tuples


def _with_sums(tree, operands, shape, dtype, x_layout):
    """The tree under a bn_stats root, its operands followed by x (mean far from 0, as a conv output's) and mean."""
    x = with_layout((torch.randn(shape) * 2 + 3).to(dtype), x_layout)
    mean = x.double().mean((0, 2, 3)).float()
    n = len(operands)
    return epi.Op("bn_stats", (tree, epi.Operand(n, "full"), epi.Operand(n + 1, "c"))), [*operands, x, mean]


def _check_sums(sums, out, x, mean):
    """sums against float64 over the g the kernel stored: each sum is off by at most fp32 rounding over its
    terms, bounded by the sum of their magnitudes."""
    g = epi.rows3(out, out.shape, 1).double().reshape(-1, out.shape[1])
    xm = epi.rows3(x, x.shape, 1).double().reshape(-1, x.shape[1]) - mean.double()
    for got, terms in zip(sums, (g, g * xm)):
        bound = 1e-5 * terms.abs().sum(0) + 1e-6
        assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) sums"
        assert ((got.double() - terms.sum(0)).abs() <= bound).all(), (got, terms.sum(0))


def _poisoned_sums(c):
    return torch.full((2, c), float("nan"))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 2), c=st.sampled_from([1, 5, 16, 37]),
       k=st.integers(1, 24), hw=pair(st.integers(1, 9), st.integers(1, 9)),
       rs=st.sampled_from([1, 3]), stride=st.sampled_from([1, 2]), x_layout=st.sampled_from(["contiguous", "channels_last"]),
       out_layout=st.sampled_from([torch.contiguous_format, torch.channels_last]), split=st.sampled_from([1, 1, 2, 3]),
       tile=st.sampled_from([None, (16, 16, 16), (32, 16, 16)]))
def test_implicit_gemm_dgrad_sums(data, dtype, n, c, k, hw, rs, stride, x_layout, out_layout, split, tile):
    pad = rs // 2
    assert all(out_size(s, rs, stride, pad, 1) >= 1 for s in hw)
    tree, roles = data.draw(trees())
    grad_out, w, in_shape = _problem(n, c, k, hw, (rs, rs), (stride,) * 2, (pad,) * 2, (1, 1), dtype, "channels_last")
    operands = [make_operand(role, kind, in_shape, 1, dtype) for kind, role in roles]
    stats_tree, all_ops = _with_sums(tree, operands, in_shape, dtype, x_layout)
    out = torch.full(in_shape, float("nan"), dtype=dtype).contiguous(memory_format=out_layout)
    sums = _poisoned_sums(c)
    cfg = None if tile is None else conv2d_bwd_data.DgradConfig(*tile, group_m=2, split_k=split, num_warps=4,
                                                                num_stages=2)
    with forced_split(split if tile is None else None):
        launch.conv2d_dgrad(grad_out, w, all_ops, str(stats_tree), [stride] * 2, [pad] * 2, [1, 1], out, cfg, sums)
    _check(out, grad_out, w, tree, operands, (stride,) * 2, (pad,) * 2, (1, 1), dtype)
    _check_sums(sums, out, *all_ops[-2:])


@settings(max_examples=20, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 3), c8=st.integers(1, 5), k8=st.integers(1, 4),
       hw=pair(st.integers(1, 9), st.integers(1, 9)), split=st.sampled_from([1, 2, 3]),
       tile=st.sampled_from([(16, 16, 16), (32, 16, 32), (16, 32, 16)]), persistent=st.sampled_from([0, 1, 2]))
def test_1x1_dgrad_sums_on_the_gemm_tma_mainloops(data, dtype, n, c8, k8, hw, split, tile, persistent):
    c, k = 8 * c8, 8 * k8  # 16-byte rows: the TMA mainloops, not the fallback
    tree, roles = data.draw(trees())
    grad_out, w, in_shape = _problem(n, c, k, hw, (1, 1), (1, 1), (0, 0), (1, 1), dtype, "channels_last")
    layouts = [data.draw(st.sampled_from([0, 1])) for _ in roles]  # NCHW or channels_last
    operands = [make_operand(role, kind, in_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    stats_tree, all_ops = _with_sums(tree, operands, in_shape, dtype, "channels_last")
    out = torch.full(in_shape, float("nan"), dtype=dtype).contiguous(memory_format=torch.channels_last)
    sums = _poisoned_sums(c)
    bulk = data.draw(st.booleans()) and (persistent or split == 1)  # a bulk output store
    cfg = conv2d_bwd_data.DgradConfig(*tile, group_m=2, split_k=1 if persistent else split, num_warps=4,
                                      num_stages=2, tma=True, persistent=persistent,
                                      tma_store=bulk)
    launch.conv2d_dgrad(grad_out, w, all_ops, str(stats_tree), [1, 1], [0, 0], [1, 1], out, cfg, sums)
    family = "gemm_tma_persistent" if persistent else "gemm_tma"
    slots = descriptor_slots(stats_tree, all_ops, in_shape, 1, cfg.split_k)
    assert (len(operands) in slots) == (dtype != torch.float32 and cfg.split_k == 1)  # x: channels_last
    out_tma = output_descriptor(out, 1, cfg.split_k) and cfg.tma_store
    assert out_tma == (dtype != torch.float32 and cfg.split_k == 1 and cfg.tma_store)  # channels_last, 16-byte rows
    assert (family, kernels.codegen.variant(str(stats_tree), slots, out_tma)) in kernels.codegen._LOADED
    _check(out, grad_out, w, tree, operands, (1, 1), (0, 0), (1, 1), dtype)
    _check_sums(sums, out, *all_ops[-2:])


@settings(max_examples=20, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 4), c=st.sampled_from([1, 5, 33, 64, 130]),
       hw=pair(st.integers(1, 17), st.integers(1, 17)), in_place=st.booleans())
def test_epilogue_kernel_sums(data, dtype, n, c, hw, in_place):
    """The "epilogue" provider's second kernel (after cuDNN's dgrad), in place on the accumulator as it runs."""
    _epilogue_kernel_sums(data.draw(trees()), dtype, (n, c, *hw), in_place)


@pytest.mark.parametrize("shape", [(3, 130, 13, 11), (2, 40, 17, 16), (1, 70, 9, 31)])
def test_epilogue_kernel_sums_over_several_row_blocks(shape):
    """Tiles of 128 rows at 130 channels, 512 at 40, 256 at 70: each of these shapes spans several."""
    _epilogue_kernel_sums((epi.parse(RESNET), [("full", "any"), ("full", "any")]), torch.float16, shape, False)


def _epilogue_kernel_sums(drawn, dtype, shape, in_place):
    tree, roles = drawn
    c = shape[1]
    acc = torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last)
    acc64 = acc.double()
    operands = [make_operand(role, kind, shape, 1, dtype) for kind, role in roles]
    stats_tree, all_ops = _with_sums(tree, operands, shape, dtype, "channels_last")
    out = acc if in_place else torch.full_like(acc, float("nan"))
    sums = _poisoned_sums(c)
    kernels.epilogue(acc, all_ops, str(stats_tree), out, 1, stats=sums)
    assert_close(epi.rows3(out, out.shape, 1), reference(acc64, tree, operands, 1), dtype)
    _check_sums(sums, out, *all_ops[-2:])


def test_resnet_tail_sums_are_bit_identical_across_runs_and_splits_agree():
    grad_out, w, in_shape = _problem(2, 20, 40, (7, 8), (3, 3), (2, 2), (1, 1), (1, 1), torch.float32,
                                     "channels_last", "channels_last")
    operands = [torch.randn(in_shape).contiguous(memory_format=torch.channels_last),
                torch.relu(torch.randn(in_shape)).contiguous(memory_format=torch.channels_last)]
    tree, all_ops = _with_sums(epi.parse(RESNET), operands, in_shape, torch.float32, "channels_last")
    runs = {}
    for split in (1, 3, 3):
        out = torch.full(in_shape, float("nan")).contiguous(memory_format=torch.channels_last)
        sums = _poisoned_sums(20)
        with forced_split(split):
            launch.conv2d_dgrad(grad_out, w, all_ops, str(tree), [2, 2], [1, 1], [1, 1], out, None, sums)
        _check_sums(sums, out, *all_ops[-2:])
        if split in runs:
            assert torch.equal(sums, runs[split]), "the sums are not deterministic"
        runs[split] = sums


def test_an_empty_output_has_zero_sums():
    tree = epi.Op("bn_stats", (epi.ACC, epi.Operand(0, "full"), epi.Operand(1, "c")))
    acc = torch.empty(0, 4, 3, 3)
    sums = _poisoned_sums(4)
    kernels.epilogue(acc, [torch.empty(0, 4, 3, 3), torch.zeros(4)], str(tree), torch.empty_like(acc), 1, stats=sums)
    assert torch.equal(sums, torch.zeros(2, 4))


def test_the_sums_output_must_match_the_signature():
    tree = epi.Op("bn_stats", (epi.ACC, epi.Operand(0, "full"), epi.Operand(1, "c")))
    acc, x = torch.randn(1, 4, 3, 3), torch.randn(1, 4, 3, 3)
    with pytest.raises(ValueError, match="needs statistics"):
        kernels.epilogue(acc, [x, torch.zeros(4)], str(tree), torch.empty_like(acc), 1)
    with pytest.raises(ValueError, match="has no statistics"):
        kernels.epilogue(acc, [], "relu(acc)", torch.empty_like(acc), 1, stats=torch.empty(2, 4))
    with pytest.raises(ValueError, match="fp32"):
        kernels.epilogue(acc, [x, torch.zeros(4)], str(tree), torch.empty_like(acc), 1, stats=torch.empty(2, 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_batch_norm_backward_from_the_producers_sums(dtype, layout):
    """Given the sums, batch_norm_backward skips its own pass over grad_out and x: all three gradients still
    match ATen in float64. The sums come from the epilogue kernel, as in a graph."""
    shape = (3, 6, 5, 7)
    g = with_layout(torch.randn(shape).to(dtype), layout)
    x = with_layout((torch.randn(shape) * 2 + 3).to(dtype), layout)
    x64 = x.double()
    save_mean = x64.mean((0, 2, 3)).float()
    save_invstd = (x64.var((0, 2, 3), unbiased=False) + 1e-5).rsqrt().float()
    w = torch.rand(6) + 0.5
    sums = _poisoned_sums(6)
    tree = epi.Op("bn_stats", (epi.ACC, epi.Operand(0, "full"), epi.Operand(1, "c")))
    g_out = torch.empty_like(g)
    kernels.epilogue(g, [x, save_mean], str(tree), g_out, 1, stats=sums)
    assert torch.equal(g_out, g)
    dx = torch.full_like(x, float("nan"))
    res = kernels.batch_norm_backward(g, x, w, save_mean, save_invstd, (True, True, True), dx, sums=sums)
    _check_bn_backward(res, g, x, w, save_mean, save_invstd, (True, True, True))
    wrong = sums.clone()
    wrong[1] += 1.0  # the sums are what the result is computed from: a wrong one shows
    res = kernels.batch_norm_backward(g, x, w, save_mean, save_invstd, (True, True, True), sums=wrong)
    assert not torch.allclose(res[1].double(), _aten64(g, x, w, save_mean, save_invstd, (True,) * 3)[1])
