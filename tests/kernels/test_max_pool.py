"""Max pooling under the interpreter against ATen on CPU in float64: values and indices bit for bit (ties, NaN,
-inf windows, padding, dilation, ceil_mode, ragged tiles, every layout), and the backward (overlapping windows,
relu's gradient fused) within the dtype's tolerance."""
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from resfuse import kernels, ops
from resfuse.ops.fused import PATHS

from .epilogues import assert_close, with_layout

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATEN = torch.ops.aten


@st.composite
def problems(draw):
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = tuple(draw(st.integers(0, k // 2)) for k in kernel)
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    shape = (draw(st.integers(1, 2)), draw(st.sampled_from([1, 3, 17, 70])), draw(st.integers(1, 11)),
             draw(st.integers(1, 11)))
    return shape, kernel, stride, padding, dilation, draw(st.booleans())


def _input(shape, dtype, layout, values):
    if values == "ties":  # few distinct values: most windows hold their maximum more than once
        x = torch.randint(-2, 3, shape).to(dtype)
    else:
        x = torch.randn(shape).to(dtype)
        if values == "special":
            flat = x.view(-1)
            picks = torch.randperm(flat.numel())[: max(1, flat.numel() // 8)]
            flat[picks] = torch.tensor([float("nan"), float("-inf"), float("inf")], dtype=dtype).repeat(
                len(picks))[: len(picks)]
    return with_layout(x, layout)


def _windows_hold_input(p, out_shape) -> bool:
    """Does every window hold an input element? (A dilated window over padding may not: ATen's index then
    points at another pixel or past the plane, where its backward aborts; a window code keeps a tap inside the
    window instead.)"""
    shape, kernel, stride, padding, dilation, _ = p
    for dim in (0, 1):
        starts = torch.arange(out_shape[2 + dim]) * stride[dim] - padding[dim]
        taps = starts[:, None] + torch.arange(kernel[dim]) * dilation[dim]
        if not ((taps >= 0) & (taps < shape[2 + dim])).any(1).all():
            return False
    return True


def _aten_forward(x, p):
    _, kernel, stride, padding, dilation, ceil_mode = p
    try:
        return ATEN.max_pool2d_with_indices(x.double(), list(kernel), list(stride), list(padding), list(dilation),
                                            ceil_mode)
    except RuntimeError:  # an invalid pooling (no output, padding too large for the dilated window)
        assume(False)


@settings(max_examples=60, deadline=None)
@given(p=problems(), dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
       values=st.sampled_from(["randn", "ties", "special"]), codes=st.sampled_from([None, torch.int8, torch.int16]))
def test_forward_matches_aten_values_and_indices(p, dtype, layout, values, codes):
    """ATen's indices, or window codes (int8, int16) that decode to them and flag the windows whose maximum is
    <= 0."""
    x = _input(p[0], dtype, layout, values)
    ref, ref_idx = _aten_forward(x, p)
    out = torch.full_like(ref, float("nan"), dtype=dtype)  # poisoned
    idx = torch.full_like(ref_idx, -7, dtype=codes or torch.int64)
    kernels.max_pool2d(x, *p[1:5], out, idx)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=0, equal_nan=True)
    if codes:
        assume(_windows_hold_input(p, ref.shape))
        assert torch.equal(idx >= 64, ref <= 0)
        idx = ops.pooling.aten_indices(idx, x.shape[3], *p[1:5])
    assert torch.equal(idx, ref_idx)


def test_forward_without_indices_and_window_of_only_minus_inf():
    x = torch.full((1, 3, 4, 4), float("-inf"))
    x[0, 1, 3, 3] = 5.0
    ref, ref_idx = ATEN.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
    out = torch.full_like(ref, float("nan"))
    kernels.max_pool2d(x, (3, 3), (2, 2), (1, 1), (1, 1), out)
    assert torch.equal(out, ref)
    idx = torch.full_like(ref_idx, -7)
    kernels.max_pool2d(x, (3, 3), (2, 2), (1, 1), (1, 1), out, idx)
    assert torch.equal(idx, ref_idx)  # all -inf: the window's first in-bounds element, as ATen on CPU


@settings(max_examples=80, deadline=None)
@given(p=problems(), dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
       values=st.sampled_from(["randn", "ties"]), relu=st.sampled_from([None, "other", "input"]),
       codes=st.sampled_from([None, torch.int8, torch.int16]))
def test_backward_matches_aten(p, dtype, layout, values, relu, codes):
    """From ATen's indices or from window codes; relu's gradient from a mask of its own ("other"), or from the
    pool's input (the stem), which window codes answer without reading it."""
    shape, kernel, stride, padding, dilation, ceil_mode = p
    x = _input(shape, dtype, layout, values)
    ref_out, idx = _aten_forward(x, p)
    assume(_windows_hold_input(p, ref_out.shape))
    g = with_layout(torch.randn(ref_out.shape).to(dtype), layout)
    ref = ATEN.max_pool2d_with_indices_backward(g.double(), x.double(), list(kernel), list(stride), list(padding),
                                                list(dilation), ceil_mode, idx)
    mask, threshold = {None: (None, 0.0), "other": (with_layout(torch.randn(shape).to(dtype), layout), 0.25),
                       "input": (x, 0.0)}[relu]
    if relu:
        ref = ATEN.threshold_backward(ref, mask.double(), threshold)
    if codes:
        idx = torch.full_like(idx, -7, dtype=codes)
        kernels.max_pool2d(x, kernel, stride, padding, dilation, torch.empty(ref_out.shape, dtype=dtype), idx)
    dx = with_layout(torch.full(shape, float("nan"), dtype=dtype), layout)  # poisoned
    kernels.max_pool2d_backward(g, idx, kernel, stride, padding, dilation, dx, mask, threshold, relu == "input")
    assert_close(dx, ref, dtype)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_ops_match_aten_layouts_and_run_the_kernels(layout):
    """The ops allocate what ATen would (layouts included), skip the indices when asked, and run our kernels."""
    x = with_layout(torch.randn(2, 5, 9, 7), layout)
    args = ([3, 3], [2, 2], [1, 1], [1, 1], False)
    ref, ref_idx = ATEN.max_pool2d_with_indices(x, *args)
    PATHS.clear()
    out, idx = ops.max_pool2d(x, *args, torch.int64, "triton")
    assert out.stride() == ref.stride() and idx.stride() == ref_idx.stride()
    assert torch.equal(out, ref) and torch.equal(idx, ref_idx)
    out2, none = ops.max_pool2d(x, *args, None, "triton")
    assert torch.equal(out2, ref) and none.numel() == 0
    out3, codes = ops.max_pool2d(x, *args, torch.int8, "triton")
    assert torch.equal(out3, ref) and codes.dtype == torch.int8 and codes.stride() == ref_idx.stride()
    g = torch.randn_like(ref)
    want = ATEN.threshold_backward(ATEN.max_pool2d_with_indices_backward(g, x, *args, ref_idx), x, 0.0)
    for indices, provider in [(idx, "triton"), (codes, "triton"), (codes, "reference")]:
        dx = ops.max_pool2d_backward(g, x, indices, *args, x.detach(), 0.0, provider)
        assert dx.stride() == want.stride()
        torch.testing.assert_close(dx, want)
    other = torch.randn_like(x)  # a mask that is not the pool's input: the codes' flag cannot stand in for it
    want = ATEN.threshold_backward(ATEN.max_pool2d_with_indices_backward(g, x, *args, ref_idx), other, 0.0)
    torch.testing.assert_close(ops.max_pool2d_backward(g, x, codes, *args, other, 0.0, "triton"), want)
    assert PATHS[("max_pool2d", "", "triton")] == 2 and PATHS[("max_pool2d", "window codes", "triton")] == 1
    assert PATHS[("max_pool2d_backward", "", "triton")] == 1
    assert PATHS[("max_pool2d_backward", "window codes", "triton")] == 2
    assert PATHS[("max_pool2d_backward", "", "reference")] == 1
    with pytest.raises(ValueError, match="window codes"):
        ops.max_pool2d(x, *args, torch.int8, "reference")


# epilogues monotone within a channel (per-channel operands c0, c1, ...; nc0: per sample and channel), in both
# directions: a batch norm's scale and the other operands are drawn with either sign
MONOTONE = ["relu(bn[#1e-05](acc,c0,c1,c2,c3))", "clamp[#0.0,#6.0](add(mul(acc,c0),c1))", "sub(c0,acc)",
            "sigmoid(div(acc,c0))", "leaky_relu[#0.1](add(acc,nc0))", "tanh(mul(c0,acc))", "hardsigmoid(acc)"]


def _operands(tree, out_shape, dtype):
    from resfuse import epilogue as epi

    ops = []
    for o in epi.operands(tree):
        t = torch.randn(out_shape[1]) if o.kind == "c" else torch.randn(out_shape[0], out_shape[1], 1, 1)
        ops.append(t.to(dtype))
    if tree.name == "relu" and tree.args[0].name == "bn":  # a variance
        ops[1] = torch.rand(out_shape[1]).to(dtype) + 0.5
    return ops


@settings(max_examples=60, deadline=None)
@given(p=problems(), dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
       values=st.sampled_from(["randn", "ties", "special"]), signature=st.sampled_from(MONOTONE))
def test_forward_of_a_monotone_epilogue_matches_eager(p, dtype, layout, values, signature):
    """max_pool2d(epilogue(x)) against ATen in float64 on the epilogue's value: the kernel evaluates the
    epilogue only at each window's largest and smallest x. NaNs where eager has them (a NaN in the window)."""
    from resfuse import epilogue as epi
    from resfuse.ops.fused import _finish

    tree = epi.parse(signature)
    x = _input(p[0], dtype, layout, values)
    operands = _operands(tree, x.shape, dtype)
    y = _finish(x.double(), torch.empty(x.shape, dtype=torch.float64), [o.double() for o in operands], signature, 1)
    ref, _ = _aten_forward(y, p)
    out = with_layout(torch.full(ref.shape, float("nan"), dtype=dtype), layout)  # poisoned
    kernels.max_pool2d_epilogue(x, operands, signature, *p[1:5], out)
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    assert_close(out.double().masked_fill(nan, 0), ref.masked_fill(nan, 0), dtype)


def test_monotone_refusal_names_what_breaks_monotonicity():
    from resfuse import epilogue as epi

    assert all(epi.monotone_refusal(epi.parse(s)) is None for s in MONOTONE)
    refused = {"gelu(acc)": "gelu is not monotone", "mul(acc,acc)": "mul of acc with acc",
               "div(c0,acc)": "a division by acc", "leaky_relu[#-0.5](acc)": "negative slope",
               "relu(add(acc,full0))": "varies within a channel", "silu(add(acc,c0))": "silu is not monotone"}
    for sig, why in refused.items():
        assert why in epi.monotone_refusal(epi.parse(sig)), sig
