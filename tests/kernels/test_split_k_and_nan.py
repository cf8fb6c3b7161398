"""Split-K determinism and NaN/Inf propagation, for both kernel families, under the interpreter."""
import pytest
import torch
import torch.nn.functional as F

from resfuse import epilogue as epi
from resfuse.kernels import launch, split_k

from .epilogues import forced_split, make_operand, reference

SIGNATURES = [
    "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))",
    "mul(leaky_relu[#0.1](add(acc,c0)),full1)",
    "clamp[#0.0,#6.0](sub(full1,hardswish(add(acc,c0))))",
    "gelu(div(acc,c0))",
]


def _operands(signature, out_shape, channel_dim, dtype):
    tree = epi.parse(signature)
    kinds = {o.slot: o.kind for o in epi.operands(tree)}
    roles = {1: "positive"} if signature.startswith("relu(add(bn") else {}
    if signature.startswith("gelu(div"):
        roles = {0: "denominator"}
    return tree, [make_operand(roles.get(s, "any"), kinds[s], out_shape, channel_dim, dtype, 1) for s in sorted(kinds)]


def _conv(signature, split, poison_input):
    torch.manual_seed(0)
    x = torch.randn(2, 24, 5, 6).contiguous(memory_format=torch.channels_last)
    w = torch.randn(20, 24, 3, 3) / 15
    if poison_input:
        x[0, 3, 1, 2] = float("nan")
        x[1, 5, 4, 0] = float("inf")
        w[7, 2, 1, 1] = float("-inf")
    tree, ops = _operands(signature, [2, 20, 5, 6], 1, x.dtype)
    out = torch.full((2, 20, 5, 6), float("nan")).contiguous(memory_format=torch.channels_last)
    with forced_split(split):
        launch.conv2d(x, w, ops, signature, [1, 1], [1, 1], [1, 1], out)
    acc = F.conv2d(x.double(), w.double(), None, 1, 1, 1)
    return epi.rows3(out, out.shape, 1), reference(acc, tree, ops, 1)


def _gemm(signature, split, poison_input):
    torch.manual_seed(1)
    a, b = torch.randn(37, 150), torch.randn(150, 45) / 12
    if poison_input:
        a[3, 10] = float("nan")
        a[20, 7] = float("inf")
        b[99, 30] = float("-inf")
    tree, ops = _operands(signature, [37, 45], -1, a.dtype)
    out = torch.full((37, 45), float("nan"))
    with forced_split(split):
        launch.gemm(a, b, ops, signature, out)
    return epi.rows3(out, out.shape, -1), reference(a.double() @ b.double(), tree, ops, -1)


@pytest.mark.parametrize("family", [_conv, _gemm])
@pytest.mark.parametrize("signature", SIGNATURES)
def test_split_k_matches_and_is_bit_identical(family, signature):
    one, ref = family(signature, 1, False)
    torch.testing.assert_close(one.double(), ref, rtol=1e-4, atol=1e-4)
    for split in (2, 3, 5):
        first, _ = family(signature, split, False)
        second, _ = family(signature, split, False)
        torch.testing.assert_close(first.double(), ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(first, second), f"split_k={split} is not deterministic"


@pytest.mark.parametrize("family", [_conv, _gemm])
@pytest.mark.parametrize("signature", SIGNATURES)
@pytest.mark.parametrize("split", [1, 3])
def test_nan_and_inf_propagate_like_eager(family, signature, split):
    out, ref = family(signature, split, True)
    assert torch.isnan(ref).any() and torch.isinf(ref).any() or torch.isnan(ref).any()
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), "NaN pattern differs from the float64 reference"
    assert torch.equal(out.isinf() & (out > 0), ref.isinf() & (ref > 0))
    assert torch.equal(out.isinf() & (out < 0), ref.isinf() & (ref < 0))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out.double()[finite], ref[finite], rtol=1e-4, atol=1e-4)


def test_each_split_launch_off_the_gpu_gets_fresh_zeroed_tickets():
    """Under the interpreter nothing persists between launches (no zeroing kernel to save: split_k keeps ticket
    buffers for CUDA streams and captured graphs only, tests/test_split_k_tickets.py)."""
    out = torch.empty(4)
    assert all(t is out for t in split_k.buffers(out, 5, 1, 16, 16))  # no split-K: never read
    ws, tickets = split_k.buffers(out, 5, 3, 16, 16)
    assert ws.numel() == 5 * 3 * 16 * 16 and ws.dtype == torch.float32
    assert tickets.dtype == torch.int32 and tickets.tolist() == [0] * 5
