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


def _aten_forward(x, p):
    _, kernel, stride, padding, dilation, ceil_mode = p
    try:
        return ATEN.max_pool2d_with_indices(x.double(), list(kernel), list(stride), list(padding), list(dilation),
                                            ceil_mode)
    except RuntimeError:  # an invalid pooling (no output, padding too large for the dilated window)
        assume(False)


@settings(max_examples=60, deadline=None)
@given(p=problems(), dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
       values=st.sampled_from(["randn", "ties", "special"]))
def test_forward_matches_aten_values_and_indices(p, dtype, layout, values):
    x = _input(p[0], dtype, layout, values)
    ref, ref_idx = _aten_forward(x, p)
    out = torch.full_like(ref, float("nan"), dtype=dtype)  # poisoned
    idx = torch.full_like(ref_idx, -7)
    kernels.max_pool2d(x, *p[1:5], out, idx)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=0, equal_nan=True)
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


@settings(max_examples=60, deadline=None)
@given(p=problems(), dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
       values=st.sampled_from(["randn", "ties"]), relu=st.booleans())
def test_backward_matches_aten(p, dtype, layout, values, relu):
    shape, kernel, stride, padding, dilation, ceil_mode = p
    x = _input(shape, dtype, layout, values)
    ref_out, idx = _aten_forward(x, p)
    g = with_layout(torch.randn(ref_out.shape).to(dtype), layout)
    ref = ATEN.max_pool2d_with_indices_backward(g.double(), x.double(), list(kernel), list(stride), list(padding),
                                                list(dilation), ceil_mode, idx)
    mask = with_layout(torch.randn(shape).to(dtype), layout) if relu else None
    if relu:
        ref = ATEN.threshold_backward(ref, mask.double(), 0.25)
    dx = with_layout(torch.full(shape, float("nan"), dtype=dtype), layout)  # poisoned
    kernels.max_pool2d_backward(g, idx, kernel, stride, padding, dilation, dx, mask, 0.25)
    assert_close(dx, ref, dtype)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_ops_match_aten_layouts_and_run_the_kernels(layout):
    """The ops allocate what ATen would (layouts included), skip the indices when asked, and run our kernels."""
    x = with_layout(torch.randn(2, 5, 9, 7), layout)
    args = ([3, 3], [2, 2], [1, 1], [1, 1], False)
    ref, ref_idx = ATEN.max_pool2d_with_indices(x, *args)
    PATHS.clear()
    out, idx = ops.max_pool2d(x, *args, True, "triton")
    assert out.stride() == ref.stride() and idx.stride() == ref_idx.stride()
    assert torch.equal(out, ref) and torch.equal(idx, ref_idx)
    out2, none = ops.max_pool2d(x, *args, False, "triton")
    assert torch.equal(out2, ref) and none.numel() == 0
    g = torch.randn_like(ref)
    want = ATEN.threshold_backward(ATEN.max_pool2d_with_indices_backward(g, x, *args, ref_idx), x, 0.0)
    dx = ops.max_pool2d_backward(g, x, idx, *args, x, 0.0, "triton")
    assert dx.stride() == want.stride()
    torch.testing.assert_close(dx, want)
    assert PATHS[("max_pool2d", "", "triton")] == 2 and PATHS[("max_pool2d_backward", "", "triton")] == 1
