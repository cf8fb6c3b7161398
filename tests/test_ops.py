"""The resfuse:: custom ops: schema, fake implementation and reference path (torch.library.opcheck)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import resfuse  # noqa: F401
from resfuse import epilogue as epi
from resfuse.ops import PATHS

BN_RELU_ADD = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))"


def test_conv2d_op_matches_unfused_and_passes_opcheck():
    x = torch.randn(2, 5, 7, 9).to(memory_format=torch.channels_last)
    w = torch.randn(6, 5, 3, 3).to(memory_format=torch.channels_last)
    mean, var, g, b = torch.randn(6), torch.rand(6) + 0.5, torch.randn(6), torch.randn(6)
    r = torch.randn(2, 6, 4, 5).to(memory_format=torch.channels_last)
    args = (x, w, [mean, var, g, b, r], BN_RELU_ADD, [2, 2], [1, 1], [1, 1], "aten")
    out = torch.ops.resfuse.conv2d(*args)
    y = F.batch_norm(F.conv2d(x, w, stride=2, padding=1), mean, var, g, b, eps=1e-5)
    torch.testing.assert_close(out, torch.relu(y + r), rtol=1e-5, atol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert PATHS[("conv2d", BN_RELU_ADD, "reference")] >= 1
    torch.library.opcheck(torch.ops.resfuse.conv2d.default, args)


def test_gemm_op_with_view_output_passes_opcheck():
    a, b, bias, r = torch.randn(6, 8), torch.randn(8, 5), torch.randn(5), torch.randn(2, 3, 5)
    sig = str(epi.Op("add", (epi.Op("add", (epi.ACC, epi.Operand(0, "c"))), epi.Operand(1, "full"))))
    args = (a, b, [bias, r], sig, [2, 3, 5], "aten")
    out = torch.ops.resfuse.gemm(*args)
    torch.testing.assert_close(out, (a @ b + bias).view(2, 3, 5) + r)
    torch.library.opcheck(torch.ops.resfuse.gemm.default, args)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 24), k=st.integers(1, 24), batch=st.sampled_from([None, 2]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_gemm_with_a_bias_alone_is_eager_linear_to_the_bit(m, n, k, batch, dtype):
    """A 2-D product whose epilogue is a bias alone runs addmm, as eager's linear layer does, so the aten path
    gives eager's numbers exactly (fp16: one rounding, not matmul's then the add's), into a [B, S, N] view too."""
    rows = m * (batch or 1)
    x, w, bias = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    shape = [batch, m, n] if batch else [rows, n]
    out = torch.ops.resfuse.gemm(x, w.t(), [bias], str(epi.LONE_BIAS), shape, "aten")
    assert torch.equal(out, F.linear(x, w, bias).view(shape))
    ref = (x.double() @ w.double().t() + bias.double()).view(shape)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)


def test_gemm_bias_of_another_dtype_or_shape_takes_the_unfused_path():
    x, w = torch.randn(7, 5, dtype=torch.bfloat16), torch.randn(5, 3, dtype=torch.bfloat16)
    for bias in (torch.randn(3), torch.randn(1, 3, dtype=torch.bfloat16)):  # fp32 bias; a [1, N] bias
        out = torch.ops.resfuse.gemm(x, w, [bias], str(epi.LONE_BIAS), [7, 3], "aten")
        ref = (x.double() @ w.double() + bias.double()).to(out.dtype)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_a_fused_call_whose_operand_does_not_fit_its_output_fails_on_fake_values():
    """The fake implementations check that every operand broadcasts to the output, so a pass that builds such a
    call fails while it runs (the graph then runs unfused, with the reason in the report) instead of at the model's
    first call; a per-channel operand fits any view of the rows."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b, rows, bias = torch.randn(6, 4), torch.randn(4, 8), torch.randn(6, 8), torch.randn(8)
        with pytest.raises(RuntimeError):
            torch.ops.resfuse.gemm(a, b, [rows], "add(acc,full0)", [2, 3, 8], "triton")
        assert torch.ops.resfuse.gemm(a, b, [rows], "add(acc,full0)", [6, 8], "triton").shape == (6, 8)
        assert torch.ops.resfuse.gemm(a, b, [bias], "add(acc,c0)", [2, 3, 8], "triton").shape == (2, 3, 8)
        x, w = torch.randn(2, 4, 5, 5), torch.randn(8, 4, 3, 3)
        with pytest.raises(RuntimeError):
            torch.ops.resfuse.conv2d(x, w, [torch.randn(2, 8, 5, 4)], "add(acc,full0)", [1, 1], [1, 1], [1, 1],
                                     "triton")
