"""The channel-padding kernel under the interpreter: out[:, :C] is x cast to out's dtype, bit for bit (the cast of
the float64 reference rounds once, as the kernel does), and the padded channels are zeros, whatever x's layout
and whatever was in out before. Into bf16 the interpreter truncates where the GPU rounds to nearest (its casts
to bf16 ignore the rounding mode), so there the bound is one bf16 step."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resfuse import kernels, ops
from resfuse.ops.fused import PATHS

from .epilogues import with_layout

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@settings(max_examples=16, deadline=None)
@given(st.integers(1, 3), st.integers(1, 5), st.integers(0, 3), st.integers(1, 13), st.integers(1, 9),
       st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.sampled_from(["contiguous", "channels_last", "strided"]),
       st.integers(0, 2**16))
def test_pad_channels_copies_casts_and_zero_fills(n, c, extra, h, w, src_dtype, dtype, layout, seed):
    torch.manual_seed(seed)
    x = with_layout(torch.randn(n, c, h, w, dtype=torch.float64) * 100, layout).to(src_dtype)
    out = torch.full((n, c + extra + 1, h, w), float("nan"), dtype=dtype).contiguous(memory_format=torch.channels_last)
    kernels.pad_channels(x, out)
    ref = x.double().to(dtype)
    if dtype == torch.bfloat16 and src_dtype != dtype:
        step = ref.double().abs() * 2.0**-7  # one bf16 step at ref's magnitude or more
        assert ((out[:, :c].double() - ref.double()).abs() <= step).all()
    else:
        assert torch.equal(out[:, :c], ref)
    assert torch.equal(out[:, c:], torch.zeros_like(out[:, c:]))


def test_pad_channels_op_takes_the_kernel_and_lays_out_channels_last():
    x = torch.randn(2, 3, 7, 5).contiguous(memory_format=torch.channels_last)
    PATHS.clear()
    out = ops.pad_channels(x, 4, torch.float16, "triton")
    ref = ops.pad_channels(x, 4, torch.float16, "reference")
    assert PATHS[("pad_channels", "", "triton")] == 1 and PATHS[("pad_channels", "", "reference")] == 1
    assert out.is_contiguous(memory_format=torch.channels_last) and out.dtype == torch.float16
    assert torch.equal(out, ref) and torch.equal(out[:, :3], x.half())
