"""The epilogue provider (ATen anchor, then our epilogue kernel) under the interpreter: correct values for every op,
and the epilogue written in place into the ATen accumulator, which the op then returns, whenever the accumulator
already is the output (dtype, shape, strides); a float32-marker output gets a tensor of its own."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import resfuse  # noqa: F401  (registers the ops)
from resfuse import kernels
from resfuse.ops import fused
from resfuse.providers import epilogue as two_kernels
from resfuse.tuning import choose as ch

CL = torch.channels_last


@pytest.fixture
def epilogue_provider(monkeypatch):
    """Every op takes the tuned "epilogue" choice; returns the accumulators ATen made and the outputs allocated."""
    kernels.set_options(interpret=True)
    monkeypatch.setattr(fused, "_use_triton", lambda device, provider: True)
    monkeypatch.setattr(ch, "choose", lambda call: ch.Choice("epilogue", None))
    accs, allocated = [], []
    real_acc, real_empty = two_kernels._accumulator, fused.Output.empty

    def accumulator(call):
        acc, channel_dim = real_acc(call)
        accs.append(acc)
        return acc, channel_dim

    monkeypatch.setattr(two_kernels, "_accumulator", accumulator)
    monkeypatch.setattr(fused.Output, "empty", lambda self: allocated.append(self) or real_empty(self))
    return accs, allocated


def _check(out, want, operands, before, accs, allocated, in_place):
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)
    assert all(torch.equal(t, b) for t, b in zip(operands, before))  # the residual is read, never written
    assert (out.data_ptr() == accs[-1].data_ptr()) == in_place
    assert (allocated == []) == in_place


def test_conv2d_fp16_channels_last_returns_the_accumulator(epilogue_provider):
    x = torch.randn(2, 4, 5, 5).half().to(memory_format=CL)
    w = torch.randn(6, 4, 3, 3).half().to(memory_format=CL)
    bias, r = torch.randn(6).half(), torch.randn(2, 6, 5, 5).half().to(memory_format=CL)
    operands = [bias, r]
    before = [t.clone() for t in operands]
    out = torch.ops.resfuse.conv2d(x, w, operands, "relu(add(add(acc,c0),full1))", [1, 1], [1, 1], [1, 1], "triton")
    want = torch.relu(F.conv2d(x.double(), w.double(), bias.double(), padding=1) + r.double())
    _check(out, want, operands, before, *epilogue_provider, in_place=True)
    assert out.dtype == torch.float16 and out.is_contiguous(memory_format=CL)


def test_conv2d_fp32_marker_writes_a_new_fp32_output(epilogue_provider):
    x = torch.randn(2, 4, 5, 5).half().to(memory_format=CL)
    w = torch.randn(6, 4, 3, 3).half().to(memory_format=CL)
    operands = [torch.randn(2, 6, 5, 5).to(memory_format=CL)]  # autocast's fp32 residual
    before = [t.clone() for t in operands]
    out = torch.ops.resfuse.conv2d(x, w, operands, "float32(add(acc,full0))", [1, 1], [1, 1], [1, 1], "triton")
    want = F.conv2d(x, w, padding=1).double() + operands[0].double()
    _check(out, want, operands, before, *epilogue_provider, in_place=False)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=CL)


def test_gemm_view_output_returns_the_accumulator(epilogue_provider):
    """A linear layer's [B, S, N] view of the [M, N] product."""
    a, b, bias, r = torch.randn(6, 8), torch.randn(8, 5), torch.randn(5), torch.randn(2, 3, 5)
    operands = [bias, r]
    before = [t.clone() for t in operands]
    out = torch.ops.resfuse.gemm(a, b, operands, "add(add(acc,c0),full1)", [2, 3, 5], "triton")
    want = (a.double() @ b.double() + bias.double()).view(2, 3, 5) + r.double()
    _check(out, want, operands, before, *epilogue_provider, in_place=True)
    assert out.shape == (2, 3, 5)


def test_gemm_fp32_marker_writes_a_new_fp32_output(epilogue_provider):
    a, b, r = torch.randn(6, 8).half(), torch.randn(8, 5).half(), torch.randn(6, 5)
    before = [r.clone()]
    out = torch.ops.resfuse.gemm(a, b, [r], "float32(add(acc,full0))", [6, 5], "triton")
    _check(out, (a @ b).double() + r.double(), [r], before, *epilogue_provider, in_place=False)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("layout", [torch.contiguous_format, CL])
def test_conv2d_dgrad_returns_the_accumulator(epilogue_provider, layout):
    grad_out = torch.randn(2, 6, 3, 3).to(memory_format=layout)
    w = torch.randn(6, 4, 3, 3).to(memory_format=layout)
    skip, relu_out = torch.randn(2, 4, 6, 6).to(memory_format=layout), torch.randn(2, 4, 6, 6).relu()
    operands = [skip, relu_out]
    before = [t.clone() for t in operands]
    sig = "threshold_bwd[#0.0](add(acc,full0),full1)"
    out = torch.ops.resfuse.conv2d_dgrad(grad_out, w, operands, sig, [2, 4, 6, 6], [2, 2], [1, 1], [1, 1], "triton")
    dx = torch.nn.grad.conv2d_input([2, 4, 6, 6], w.double(), grad_out.double(), stride=2, padding=1)
    want = torch.where(relu_out > 0, dx + skip.double(), 0.0)
    _check(out, want, operands, before, *epilogue_provider, in_place=True)


def test_tuning_the_epilogue_candidate_leaves_the_operands_alone():
    """The candidate writes into its own fresh accumulator, never into an operand holding live data."""
    kernels.set_options(interpret=True)
    grad_out, w = torch.randn(2, 6, 3, 3), torch.randn(6, 4, 3, 3)
    operands = [torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6).relu()]
    before = [t.clone() for t in operands]
    call = ch.Call("conv2d_dgrad", (grad_out, w), operands, "threshold_bwd[#0.0](add(acc,full0),full1)",
                   ([2, 2], [1, 1], [1, 1]), fused.Output.of([2, 4, 6, 6], torch.float32, w.device))
    (candidate,) = two_kernels.candidates(call, "fast")
    first, second = candidate.run(), candidate.run()
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, second)
    assert all(torch.equal(t, b) for t, b in zip(operands, before))


def test_dense_strides_are_torch_empty_strides():
    for rank in (1, 2, 3, 4):
        for shape in itertools.product([0, 1, 2, 3], repeat=rank):
            for fmt in (torch.contiguous_format, CL) if rank == 4 else (torch.contiguous_format,):
                assert fused.dense_strides(shape, fmt) == torch.empty(shape, memory_format=fmt).stride(), (shape, fmt)


def _calls_of_every_anchor():
    h, f32 = torch.float16, torch.float32
    x, w = torch.randn(2, 4, 5, 5).half().to(memory_format=CL), torch.randn(6, 4, 3, 3).half().to(memory_format=CL)
    yield ch.Call("conv2d", (x, w), [torch.randn(6).half()], "relu(add(acc,c0))", ([1, 1], [1, 1], [1, 1]),
                  fused.Output.of([2, 6, 5, 5], h, x.device, CL))
    yield ch.Call("conv2d", (x.contiguous().float(), w.contiguous().float()), [torch.randn(2, 6, 3, 3)],
                  "float32(add(acc,full0))", ([2, 2], [1, 1], [1, 1]), fused.Output.of([2, 6, 3, 3], f32, x.device))
    yield ch.Call("gemm", (torch.randn(6, 8), torch.randn(8, 5)), [torch.randn(5)], "add(acc,c0)", ([2, 3, 5],),
                  fused.Output.of([2, 3, 5], f32, x.device))
    for layout in (torch.contiguous_format, CL):
        g, wd = torch.randn(2, 6, 3, 3).to(memory_format=layout), torch.randn(6, 4, 3, 3).to(memory_format=layout)
        yield ch.Call("conv2d_dgrad", (g, wd), [torch.randn(2, 4, 6, 6).relu()], "threshold_bwd[#0.0](acc,full0)",
                      ([2, 2], [1, 1], [1, 1]), fused.Output.of([2, 4, 6, 6], f32, x.device, layout))


@pytest.mark.parametrize("call", list(_calls_of_every_anchor()), ids=lambda c: c.op)
def test_the_kernel_alone_sees_the_accumulator_the_candidate_sees(monkeypatch, call):
    """The compile workers' launch of the epilogue kernel (kernel_only, no conv) gets an accumulator laid out as the
    real run's, the same channel dim and the same output (the accumulator itself, or a new one), so it compiles the
    kernel the run then launches."""
    seen = []

    def epilogue(acc, operands, signature, out, channel_dim, aux, stats):
        seen.append((acc.shape, acc.stride(), acc.dtype, out.shape, out.stride(), out.dtype,
                     out.data_ptr() == acc.data_ptr(), channel_dim, signature))
        return out

    monkeypatch.setattr(two_kernels.kernels, "epilogue", epilogue)
    (candidate,) = two_kernels.candidates(call, "fast")
    candidate.run()
    candidate.triton_part()
    assert len(seen) == 2 and seen[0] == seen[1], seen
