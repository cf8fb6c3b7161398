"""The max-pool that computes a monotone epilogue (kernels/max_pool.py's window_extremes) on NaN, infinities and ties,
on every device the kernels run on here: under the interpreter on CPU tensors (CI), and compiled on a GPU
(`TRITON_INTERPRET=0 pytest -m requires_cuda tests/test_pool_nan.py`). The GPU case matters: the extremes are
tl.maximum / tl.minimum with propagate_nan, and the interpreter's maximum propagates a NaN whatever that flag says
(numpy's), while a GPU's does not; so only the compiled kernel can show a NaN lost. tests/kernels/test_max_pool.py
draws the geometry and layouts; this is one stem-like case per epilogue direction."""
import pytest
import torch
import torch.nn.functional as F

from resfuse import epilogue as epi
from resfuse import kernels

from .kernel_devices import DEVICES, skip_unless_available

SIGNATURES = ["relu(bn[#1e-05](acc,c0,c1,c2,c3))", "sub(c0,acc)", "tanh(mul(c0,acc))"]  # both directions per channel


def _image(n, c, h, w, dtype):
    """Random values with a NaN, a +inf and a -inf in some windows, and many ties."""
    x = torch.randint(-3, 4, (n, c, h, w)).to(dtype)
    flat = x.view(-1)
    picks = torch.randperm(flat.numel())[: flat.numel() // 10]
    flat[picks] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype).repeat(len(picks))[
        : len(picks)]
    return x.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signature", SIGNATURES)
def test_epilogue_pool_keeps_every_nan_and_extreme(device, signature):
    skip_unless_available(device)
    torch.manual_seed(0)
    dtype = torch.float16
    x = _image(2, 24, 15, 13, dtype)
    tree = epi.parse(signature)
    operands = [torch.randn(24).to(dtype) for _ in epi.operands(tree)]
    if len(operands) == 4:
        operands[1] = (torch.rand(24) + 0.5).to(dtype)  # a variance
    acc3 = epi.rows3(x.double(), x.shape, 1)
    ops3 = epi.operand_views(tree, [o.double() for o in operands], x.shape, 1)
    y = epi.reference(tree, acc3, ops3).reshape(2, -1, 24).transpose(1, 2).reshape(x.shape)
    ref = F.max_pool2d(y, 3, 2, 1)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=device).contiguous(
        memory_format=torch.channels_last)
    kernels.max_pool2d_epilogue(x.to(device), [o.to(device) for o in operands], signature, [3, 3], [2, 2], [1, 1],
                                [1, 1], out)
    out = out.cpu().double()
    nan = ref.isnan()
    assert nan.any() and torch.equal(out.isnan(), nan), "a NaN window lost its NaN, or a NaN appeared"
    assert torch.equal(out.masked_fill(nan, 0) == float("inf"), ref.masked_fill(nan, 0) == float("inf"))
    assert torch.allclose(out.masked_fill(nan, 0), ref.masked_fill(nan, 0).to(dtype).double(), rtol=2e-3, atol=2e-3)
