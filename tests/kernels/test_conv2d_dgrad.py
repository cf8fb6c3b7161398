"""Conv2d dgrad kernel numerics under the interpreter: epilogues (the ResNet skip-gradient + relu-gradient tail
among them), stride/padding/dilation and the strided-phase edge cases, layouts, split-K, NaN/Inf, determinism."""
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse.kernels import codegen, conv2d_bwd_data, launch

from .epilogues import (assert_close, descriptor_slots, forced_split, make_operand, output_descriptor, reference, trees,
                        with_layout)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RESNET = "threshold_bwd[#0.0](add(acc,full0),full1)"  # relu_backward(dgrad + grad_shortcut, relu_out)


def out_size(size, k, stride, pad, dil):
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


def grad_input64(grad_out, w, in_shape, stride, padding, dilation):
    x = torch.zeros(in_shape, dtype=torch.float64)  # only its shape is read
    return torch.ops.aten.convolution_backward(grad_out.double(), x, w.double(), None, list(stride), list(padding),
                                               list(dilation), False, [0, 0], 1, [True, False, False])[0]


def run_dgrad(grad_out, w, signature, operands, in_shape, stride, padding, dilation, out_layout):
    out = torch.full(in_shape, float("nan"), dtype=grad_out.dtype).contiguous(memory_format=out_layout)
    return launch.conv2d_dgrad(grad_out, w, operands, str(signature), list(stride), list(padding), list(dilation), out)



def _problem(n, c, k, hw, rs, stride, padding, dilation, dtype, go_layout="contiguous", w_layout="contiguous"):
    oh, ow = (out_size(*a) for a in zip(hw, rs, stride, padding, dilation))
    grad_out = with_layout(torch.randn(n, k, oh, ow).to(dtype), go_layout)
    w = with_layout((torch.randn(k, c, *rs) / (k * rs[0] * rs[1]) ** 0.5).to(dtype), w_layout)
    return grad_out, w, (n, c, *hw)


def _check(out, grad_out, w, tree, operands, stride, padding, dilation, dtype):
    acc = grad_input64(grad_out, w, out.shape, stride, padding, dilation)
    assert_close(epi.rows3(out, out.shape, 1), reference(acc, tree, operands, 1), dtype)


pair = st.tuples


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 2), c=st.sampled_from([1, 3, 5, 16, 20, 37]),
       k=st.integers(1, 40), hw=pair(st.integers(1, 10), st.integers(1, 10)),
       rs=pair(st.sampled_from([1, 2, 3, 5, 7]), st.sampled_from([1, 3])),
       stride=pair(st.sampled_from([1, 2, 3]), st.sampled_from([1, 2])), padding=pair(st.integers(0, 3), st.integers(0, 1)),
       dilation=pair(st.sampled_from([1, 2]), st.sampled_from([1, 2])),
       go_layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
       w_layout=st.sampled_from(["contiguous", "channels_last"]),
       out_layout=st.sampled_from([torch.contiguous_format, torch.channels_last]), split=st.sampled_from([1, 1, 2, 3, 5]))
def test_dgrad_epilogues(data, dtype, n, c, k, hw, rs, stride, padding, dilation, go_layout, w_layout, out_layout, split):
    assume(all(out_size(*a) >= 1 for a in zip(hw, rs, stride, padding, dilation)))
    tree, roles = data.draw(trees())
    grad_out, w, in_shape = _problem(n, c, k, hw, rs, stride, padding, dilation, dtype, go_layout, w_layout)
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, in_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    with forced_split(split):
        out = run_dgrad(grad_out, w, tree, operands, in_shape, stride, padding, dilation, out_layout)
    _check(out, grad_out, w, tree, operands, stride, padding, dilation, dtype)


@pytest.mark.parametrize("c, k, hw, r, stride, pad, dil", [
    (20, 24, (7, 6), 1, 1, 0, 1),  # 1x1
    (37, 19, (8, 7), 3, 1, 1, 1),  # 3x3, C and K not multiples of a tile
    (20, 24, (8, 9), 3, 2, 1, 1),  # stride 2: (8 + 2 - 2 - 1) % 2 != 0, so the last row misses taps
    (16, 24, (7, 7), 1, 2, 0, 1),  # the 1x1 stride-2 downsample: odd pixels get no gradient at all
    (3, 16, (11, 10), 7, 2, 3, 1),  # the RGB stem: tiny C, 7x7 stride 2 pad 3
    (5, 12, (9, 9), 3, 1, 2, 2),  # dilation 2
    (5, 12, (9, 10), 3, 2, 2, 2),  # stride 2 and dilation 2 share a factor: half the phases get no tap
    (5, 12, (10, 9), 5, 3, 2, 1),  # stride 3
])
def test_dgrad_geometry(c, k, hw, r, stride, pad, dil):
    rs, st2, pd, dl = (r, r), (stride, stride), (pad, pad), (dil, dil)
    grad_out, w, in_shape = _problem(2, c, k, hw, rs, st2, pd, dl, torch.float32, "channels_last")
    out = run_dgrad(grad_out, w, "acc", [], in_shape, st2, pd, dl, torch.channels_last)
    _check(out, grad_out, w, epi.ACC, [], st2, pd, dl, torch.float32)


def _resnet_operands(in_shape, dtype):
    grad_shortcut = torch.randn(in_shape).to(dtype).contiguous(memory_format=torch.channels_last)
    relu_out = torch.relu(torch.randn(in_shape)).to(dtype).contiguous(memory_format=torch.channels_last)
    return [grad_shortcut, relu_out]


@pytest.mark.parametrize("r, stride, pad", [(3, 1, 1), (1, 1, 0), (3, 2, 1), (1, 2, 0)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 3])
def test_resnet_skip_and_relu_gradient(r, stride, pad, dtype, split):
    """grad_x = dgrad(conv) + grad_shortcut, then relu's backward against the block input: one kernel."""
    grad_out, w, in_shape = _problem(2, 20, 24, (9, 9), (r, r), (stride,) * 2, (pad,) * 2, (1, 1), dtype,
                                     "channels_last", "channels_last")
    operands = _resnet_operands(in_shape, dtype)
    with forced_split(split):
        out = run_dgrad(grad_out, w, RESNET, operands, in_shape, (stride,) * 2, (pad,) * 2, (1, 1), torch.channels_last)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert (out[operands[1] == 0] == 0).all(), "relu's gradient must be exactly 0 where the block input was"
    _check(out, grad_out, w, epi.parse(RESNET), operands, (stride,) * 2, (pad,) * 2, (1, 1), dtype)


def _poisoned(signature, r, stride, pad, split, poison_weight):
    torch.manual_seed(0)
    grad_out, w, in_shape = _problem(2, 20, 24, (9, 8), (r, r), (stride,) * 2, (pad,) * 2, (1, 1), torch.float32,
                                     "channels_last")
    grad_out[0, 3, 1, 2] = float("nan")
    grad_out[1, 5, 2, 0] = float("inf")
    grad_out[1, 6, 3, 3] = float("-inf")
    if poison_weight:
        w[7, 2, 0, 0] = float("-inf")
    operands = _resnet_operands(in_shape, torch.float32)[: len(epi.operands(epi.parse(signature)))]
    with forced_split(split):
        out = run_dgrad(grad_out, w, signature, operands, in_shape, (stride,) * 2, (pad,) * 2, (1, 1),
                        torch.channels_last)
    acc = grad_input64(grad_out, w, in_shape, (stride,) * 2, (pad,) * 2, (1, 1))
    return epi.rows3(out, out.shape, 1), reference(acc, epi.parse(signature), operands, 1)


@pytest.mark.parametrize("signature", ["acc", "add(acc,full0)", RESNET])
@pytest.mark.parametrize("r, stride, pad, poison_weight", [
    (3, 1, 1, False), (3, 2, 1, False),
    # An Inf weight only where every tap is in range: an out-of-range tap multiplies the zero fill by the weight
    # (0 * inf = NaN), a product aten's col2im never forms. The odd pixels of this one get no taps at all.
    (1, 2, 0, True),
])
@pytest.mark.parametrize("split", [1, 3])
def test_nan_and_inf_propagate_like_eager(signature, r, stride, pad, poison_weight, split):
    out, ref = _poisoned(signature, r, stride, pad, split, poison_weight)
    assert torch.isnan(ref).any() or signature == RESNET
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaN pattern differs from the float64 reference"
    assert torch.equal(out.isinf() & (out > 0), ref.isinf() & (ref > 0))
    assert torch.equal(out.isinf() & (out < 0), ref.isinf() & (ref < 0))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out.double()[finite], ref[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("r, stride, pad", [(3, 1, 1), (3, 2, 1)])
def test_split_k_matches_and_is_bit_identical(r, stride, pad):
    grad_out, w, in_shape = _problem(2, 20, 40, (7, 8), (r, r), (stride,) * 2, (pad,) * 2, (1, 1), torch.float32,
                                     "channels_last", "channels_last")
    operands = _resnet_operands(in_shape, torch.float32)
    runs = {}
    for split in (1, 2, 3, 3, 5):
        with forced_split(split):
            out = run_dgrad(grad_out, w, RESNET, operands, in_shape, (stride,) * 2, (pad,) * 2, (1, 1),
                            torch.channels_last)
        _check(out, grad_out, w, epi.parse(RESNET), operands, (stride,) * 2, (pad,) * 2, (1, 1), torch.float32)
        if split in runs:
            assert torch.equal(out, runs[split]), f"split_k={split} is not deterministic"
        runs[split] = out


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 3), c=st.sampled_from([8, 16, 24, 40, 20, 37]),
       k8=st.integers(1, 5),
       hw=pair(st.integers(1, 9), st.integers(1, 9)), w_layout=st.sampled_from(["contiguous", "channels_last"]),
       out_layout=st.sampled_from([torch.channels_last, torch.contiguous_format]), split=st.sampled_from([1, 2, 3]),
       tile=st.sampled_from([(16, 16, 16), (32, 16, 32), (16, 32, 16)]), persistent=st.sampled_from([0, 1, 2]))
def test_1x1_dgrad_on_the_gemm_tma_mainloop(data, dtype, n, c, k8, hw, w_layout, out_layout, split, tile, persistent):
    """A 1x1 stride-1 dgrad of a channels_last grad_out is the GEMM [N*H*W, K] @ W [K, C]: with tma=True it runs
    the GEMM's TMA mainloop (persistent > 0: the persistent kernel), its epilogue rows per sample, into either
    output layout."""
    k = 8 * k8  # 16-byte grad_out rows for every dtype
    tree, roles = data.draw(trees())
    grad_out, w, in_shape = _problem(n, c, k, hw, (1, 1), (1, 1), (0, 0), (1, 1), dtype, "channels_last", w_layout)
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, in_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    out = torch.full(in_shape, float("nan"), dtype=dtype).contiguous(memory_format=out_layout)
    tma = launch.dgrad_as_gemm(grad_out, w, [1, 1], [0, 0], out.stride()) is not None
    assert tma == (c * w.element_size() % 16 == 0)  # a misaligned weight row keeps the implicit-GEMM mainloop
    bulk = data.draw(st.booleans()) and (persistent or split == 1)  # a bulk output store
    cfg = conv2d_bwd_data.DgradConfig(*tile, group_m=2, split_k=1 if persistent else split, num_warps=4,
                                      num_stages=2, tma=True, persistent=persistent,
                                      tma_store=bulk)
    launch.conv2d_dgrad(grad_out, w, operands, str(tree), [1, 1], [0, 0], [1, 1], out, cfg)
    family = "gemm_tma_persistent" if persistent else "gemm_tma"
    slots = descriptor_slots(tree, operands, in_shape, 1, cfg.split_k)
    out_tma = output_descriptor(out, 1, cfg.split_k) and cfg.tma_store
    assert ((family, codegen.variant(str(tree), slots, out_tma)) in codegen._LOADED) or not tma  # not the fallback
    _check(out, grad_out, w, tree, operands, (1, 1), (0, 0), (1, 1), dtype)


def test_plan_is_reused():
    grad_out, w, in_shape = _problem(1, 8, 12, (6, 6), (3, 3), (2, 2), (1, 1), (1, 1), torch.float32)
    before = len(launch._PLANS)
    for _ in range(2):
        out = run_dgrad(grad_out, w, "acc", [], in_shape, (2, 2), (1, 1), (1, 1), torch.contiguous_format)
    assert len(launch._PLANS) == before + 1
    _check(out, grad_out, w, epi.ACC, [], (2, 2), (1, 1), (1, 1), torch.float32)


def test_dgrad_rejects_groups_and_mismatched_shapes():
    grad_out, w = torch.randn(1, 4, 5, 5), torch.randn(4, 2, 3, 3)
    with pytest.raises(NotImplementedError):  # groups=2: grad_input has 4 channels, the weight 2
        launch.conv2d_dgrad(grad_out, w, [], "acc", [1, 1], [1, 1], [1, 1], torch.empty(1, 4, 5, 5))
    with pytest.raises(ValueError):  # a 5x5 grad_out cannot come from a 9x9 input with stride 1, pad 1
        launch.conv2d_dgrad(grad_out, torch.randn(4, 4, 3, 3), [], "acc", [1, 1], [1, 1], [1, 1],
                            torch.empty(1, 4, 9, 9))


def test_default_configs_are_legal_and_split_deep_small_layers():
    # ResNet-50 layer4 3x3 dgrad at batch 1 on an H100: 49 pixels x 512 channels, 4608-deep reduction
    p = conv2d_bwd_data.DgradProblem(1, 512, 512, 3, 3, 7, 7, 1, 1, 2, 132)
    cfg = conv2d_bwd_data.default_config(p)
    assert cfg.check(p) and cfg.split_k > 1
    big = conv2d_bwd_data.DgradProblem(32, 128, 128, 3, 3, 56, 56, 2, 2, 2, 132)  # layer2's stride-2 3x3
    assert conv2d_bwd_data.default_config(big).check(big) and conv2d_bwd_data.default_config(big).split_k == 1
    for c in (3, 64, 2048):
        for k in (1, 64, 512):
            p = conv2d_bwd_data.DgradProblem(2, c, k, 7, 7, 30, 30, 2, 2, 4, 1)
            assert conv2d_bwd_data.default_config(p).check(p)


@pytest.mark.parametrize("stride, dil", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2), (4, 6), (6, 4)])
def test_tap_inverse_finds_every_tap(stride, dil):
    """The host half of phase_taps, checked against brute force in plain Python."""
    g, inv = conv2d_bwd_data.tap_inverse(stride, dil)
    step = stride // g
    for pad in range(4):
        for ph in range(stride):
            taps = [r for r in range(9) if (ph + pad - r * dil) % stride == 0]
            a = ph + pad
            if a % g:
                assert not taps
                continue
            r0 = (a // g * inv) % step
            assert taps == list(range(r0, 9, step))
            d0 = (a + (step - r0) * dil) // stride - dil // g
            assert all((ph + pad - r * dil) // stride == d0 - j * (dil // g) for j, r in enumerate(taps))


@settings(max_examples=30, deadline=None)
@given(c=st.integers(1, 6), k=st.integers(1, 6), h=st.integers(1, 12), w=st.integers(1, 12),
       rs=st.sampled_from([(1, 1), (3, 3), (7, 7), (1, 3)]), stride=st.integers(1, 3), pad=st.integers(0, 3),
       dil=st.integers(1, 2), channels_last=st.booleans())
def test_cudnn_dgrad_as_transposed_conv_matches_convolution_backward(c, k, h, w, rs, stride, pad, dil,
                                                                      channels_last):
    """The epilogue provider's ATen dgrad is a transposed convolution (output_padding recovers the input size
    that strided rows dropped); it keeps channels_last, where convolution_backward on a stand-in input
    copied a whole input-sized tensor. Where neither the gradient nor the weight tells the layouts apart (one
    output channel and a 1x1 filter, say), ATen and the op's declared output (conv_out_format) both take
    contiguous."""
    from resfuse.ops.fused import conv_out_format
    from resfuse.ops.training import cudnn_dgrad

    assume(all(out_size(n, r, stride, pad, dil) >= 1 for n, r in zip((h, w), rs)))
    layout = "channels_last" if channels_last else "contiguous"
    grad_out, wt, in_shape = _problem(2, c, k, (h, w), rs, (stride,) * 2, (pad,) * 2, (dil,) * 2, torch.float64,
                                      layout, layout)
    got = cudnn_dgrad(grad_out, wt, in_shape, [stride] * 2, [pad] * 2, [dil] * 2)
    want = grad_input64(grad_out, wt, in_shape, (stride,) * 2, (pad,) * 2, (dil,) * 2)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-10, atol=1e-10)
    if channels_last and c > 1 and h * w > 1 and conv_out_format(grad_out, wt) == torch.channels_last:
        assert got.is_contiguous(memory_format=torch.channels_last)
