"""The epilogue-only kernel (kernels/elementwise.py: the "epilogue" provider's pass after a cuDNN conv or cuBLAS
matmul) on random epilogues under the interpreter, against float64: conv outputs and [M, N] products, operands in
every layout, in place on the accumulator or not."""
import torch
from hypothesis import given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse.kernels import codegen, elementwise

from .epilogues import assert_close, descriptor_slots, glu, make_operand, reference, trees

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
    elementwise.epilogue(acc, operands, str(tree), out, cdim)
    assert ("ewise", codegen.variant(str(tree), descriptor_slots(tree, operands, shape, cdim, 1))) in codegen._LOADED
    assert_close(epi.rows3(out, out.shape, cdim), reference(acc64, tree, operands, cdim), dtype)


def test_channel_vectors_only_where_triton_cannot_see_the_alignment():
    """KV: 1 where the channel count and the row strides are 16-divisible, else the largest of 8, 4, 2, 1 that
    divides them all; the pass is exact either way, over channel blocks that end past the last channel."""
    from resfuse.kernels.elementwise import channel_vector
    assert [channel_vector(*v) for v in [(64, 64, 4096), (72, 72, 72 * 49), (20, 20, 20 * 9), (40, 40, 1),
                                         (17, 17)]] == [1, 8, 4, 1, 1]
    for c, kv in [(72, 8), (20, 4), (64, 1)]:
        acc = torch.randn(2, c, 3, 5).contiguous(memory_format=torch.channels_last)
        bias = torch.randn(c)
        out = torch.full_like(acc, float("nan"))
        elementwise._PLANS.clear()
        elementwise.epilogue(acc, [bias], "relu(add(acc,c0))", out, 1)
        (plan,) = elementwise._PLANS.values()
        assert plan.meta["KV"] == kv
        torch.testing.assert_close(out, torch.relu(acc + bias.view(1, -1, 1, 1)))


@settings(max_examples=25, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), rows=st.integers(1, 40), c=st.sampled_from([1, 5, 20, 36, 72]),
       samples=st.sampled_from([1, 2]))
def test_a_glu_epilogue_pairs_cublas_product(data, dtype, rows, c, samples):
    """A GLU's epilogue (epilogue.paired) on a [.., 2C] product whose columns alternate gate and up, into a [.., C]
    output: the epilogue provider's pass after cuBLAS. Operands are the output's shape, read through pointers."""
    tree, roles = data.draw(trees(kinds=("c", "full"), max_steps=2))
    tree = glu(tree, data.draw(st.sampled_from(["silu", "gelu", "relu"])))
    shape = (samples, rows, c)
    acc = torch.randn(samples, rows, 2 * c).to(dtype)
    operands = [make_operand(role, kind, shape, -1, dtype, data.draw(st.sampled_from([0, 1, 2])))
                for kind, role in roles]
    out = torch.full(shape, float("nan"), dtype=dtype)
    elementwise.epilogue(acc, operands, str(tree), out, -1)
    assert_close(epi.rows3(out, out.shape, -1), reference(acc.double(), tree, operands, -1), dtype)
