"""The epilogue-only kernel (kernels/elementwise.py: the "epilogue" provider's pass after a cuDNN conv or cuBLAS
matmul) on random epilogues under the interpreter, against float64: conv outputs and [M, N] products, operands in
every layout, in place on the accumulator or not."""
import torch
from hypothesis import given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse.kernels import codegen, launch

from .epilogues import assert_close, descriptor_slots, make_operand, reference, trees

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), n=st.integers(1, 3), c=st.sampled_from([1, 8, 20, 40, 72, 136]),
       hw=st.tuples(st.integers(1, 9), st.integers(1, 9)), conv=st.booleans(), in_place=st.booleans())
def test_epilogue_kernel(data, dtype, n, c, hw, conv, in_place):
    """Full 16-bit operands whose rows are the output's, 16-byte aligned (channels_last for a conv, contiguous
    for a product), are read through tensor descriptors; the rest through pointers."""
    tree, roles = data.draw(trees(kinds=("c", "nc", "full") if conv else ("c", "full")))  # [M, N]: one sample
    shape, cdim = ((n, c, *hw), 1) if conv else ((n * hw[0], c), -1)
    acc = torch.randn(shape).to(dtype)
    if conv:
        acc = acc.contiguous(memory_format=torch.channels_last)
    layouts = [data.draw(st.sampled_from([0, 1, 2])) for _ in roles]  # contiguous, channels innermost, strided
    operands = [make_operand(role, kind, shape, cdim, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    acc64 = acc.double()
    out = acc if in_place else torch.full_like(acc, float("nan"))
    launch.epilogue(acc, operands, str(tree), out, cdim)
    assert ("ewise", codegen.variant(str(tree), descriptor_slots(tree, operands, shape, cdim, 1))) in codegen._LOADED
    assert_close(epi.rows3(out, out.shape, cdim), reference(acc64, tree, operands, cdim), dtype)
