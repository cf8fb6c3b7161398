"""GEMM kernel numerics under the interpreter: random epilogues, strides, dtypes, batch and split-K."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from resfuse import kernels
from resfuse.kernels import codegen, launch
from resfuse.kernels.matmul import GemmProblem

from resfuse import epilogue as epi

from .epilogues import (assert_close, check_aux, descriptor_slots, forced_split, glu, make_operand, output_descriptor,
                        poisoned_aux, reference,
                        trees)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _matrix(shape, dtype, col_major):
    """A random [.., R, C] tensor, stored row- or column-major."""
    if col_major:
        return torch.randn(*shape[:-2], shape[-1], shape[-2]).to(dtype).transpose(-1, -2)
    return torch.randn(shape).to(dtype)


def run_gemm(a, b, tree, operands, aux=None):
    shape = [*a.shape[:-1], b.shape[-1]]
    out = torch.full(shape, float("nan"), dtype=a.dtype)  # poison: every element must be written
    return launch.gemm(a, b, operands, str(tree), out, aux=aux)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), batch=st.sampled_from([0, 0, 2]),
       m=st.integers(1, 70), n=st.integers(1, 70), k=st.integers(1, 90),
       a_cm=st.booleans(), b_cm=st.booleans(), split=st.sampled_from([1, 1, 2, 3, 5]))
def test_gemm_epilogues(data, dtype, batch, m, n, k, a_cm, b_cm, split):
    kinds = ("c", "nc", "full") if batch else ("c", "full")  # an mm output has one sample: nc is c
    tree, roles = data.draw(trees(kinds=kinds, aux=True))
    lead = [batch] if batch else []
    a = _matrix([*lead, m, k], dtype, a_cm)
    b = _matrix([*lead, k, n], dtype, b_cm) / k ** 0.5
    out_shape = [*lead, m, n]
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, out_shape, -1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    aux = poisoned_aux(tree, torch.empty(out_shape, dtype=dtype))
    with forced_split(split):
        out = run_gemm(a, b, tree, operands, aux)
    acc = torch.matmul(a.double(), b.double())
    ref = reference(acc, tree, operands, -1)
    assert_close(epi.rows3(out, out.shape, -1), ref, dtype)
    check_aux(aux, acc, tree, operands, -1, dtype)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), m=st.integers(1, 70), n=st.integers(1, 70), k=st.integers(1, 90),
       a_cm=st.booleans(), b_cm=st.booleans(), split=st.sampled_from([1, 2, 3]), out3=st.booleans(),
       tile=st.sampled_from([(32, 16, 16), (16, 32, 16), (16, 16, 32)]))
def test_swapped_gemm_epilogues(data, dtype, m, n, k, a_cm, b_cm, split, out3, tile):
    """GemmConfig.swap: the product computed as its transpose, the output's channels along the tile's rows; every
    epilogue reads its per-channel, per-sample and full operands with the tile's roles swapped (and writes the aux
    output), into a [M, N] output or a [1, M, N] view, against float64."""
    tree, roles = data.draw(trees(kinds=("c", "nc", "full") if out3 else ("c", "full"), aux=True))
    a = _matrix([m, k], dtype, a_cm)
    b = _matrix([k, n], dtype, b_cm) / k ** 0.5
    out_shape = [1, m, n] if out3 else [m, n]
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, out_shape, -1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    aux = poisoned_aux(tree, torch.empty(out_shape, dtype=dtype))
    out = torch.full(out_shape, float("nan"), dtype=dtype)
    cfg = launch.GemmConfig(*tile, group_m=2, split_k=split, num_warps=4, num_stages=2, swap=True)
    launch.gemm(a, b, operands, str(tree), out, cfg, aux=aux)
    assert ("gemm", codegen.variant(str(tree), swap=True)) in codegen._LOADED
    acc = (a.double() @ b.double()).reshape(out_shape)
    assert_close(epi.rows3(out, out.shape, -1), reference(acc, tree, operands, -1), dtype)
    check_aux(aux, acc, tree, operands, -1, dtype)


def test_a_swapped_config_refuses_a_batched_product_or_an_output_of_several_samples():
    a, b, cfg = torch.randn(6, 8), torch.randn(8, 4), launch.GemmConfig(16, 16, 16, swap=True)
    with pytest.raises(NotImplementedError):
        launch.gemm(a, b, [], "acc", torch.empty(2, 3, 4), cfg)  # [B, S, N]: two samples
    with pytest.raises(NotImplementedError):
        launch.gemm(torch.randn(2, 6, 8), b, [], "acc", torch.empty(2, 6, 4), cfg)
    assert not cfg.check(GemmProblem(2, 6, 4, 8, 4, 1)) and cfg.check(GemmProblem(1, 6, 4, 8, 4, 1))
    assert not launch.GemmConfig(16, 16, 16, swap=True, tma=True).check(GemmProblem(1, 6, 4, 8, 4, 1))


def test_gemm_shared_b_across_batch():
    a = torch.randn(3, 20, 33)
    b = torch.randn(33, 17)
    bias = torch.randn(17)
    out = torch.full((3, 20, 17), float("nan"))
    with forced_split(2):
        launch.gemm(a, b, [bias], "silu(add(acc,c0))", out)
    ref = torch.nn.functional.silu(a.double() @ b.double() + bias.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_gemm_writes_through_output_strides():
    a, b = torch.randn(19, 24), torch.randn(24, 21)
    storage = torch.full((21, 40), float("nan"))
    out = storage[:, :19].t()  # column-major, padded
    launch.gemm(a, b, [], "relu(acc)", out)
    torch.testing.assert_close(out.double(), torch.relu(a.double() @ b.double()), rtol=1e-4, atol=1e-4)
    assert torch.isnan(storage[:, 19:]).all(), "wrote outside the output view"


def test_gemm_rejects_mixed_dtypes():
    with pytest.raises(TypeError):
        launch.gemm(torch.randn(4, 4), torch.randn(4, 4).half(), [], "acc", torch.empty(4, 4))
    assert kernels.options()["interpret"]


@pytest.mark.parametrize("split", [1, 3])
def test_linear_layer_product_written_as_batch_seq_channels(split):
    # [B*S, K] @ [K, N] written into [B, S, N]; per-(sample, channel) and strided full operands index by (b, s)
    a, b = torch.randn(3 * 7, 30), torch.randn(30, 26) / 6
    nc = torch.randn(3, 1, 26)
    full = torch.randn(26, 7, 3).permute(2, 1, 0)
    out = torch.full((3, 7, 26), float("nan"))
    sig = "mul(gelu(add(acc,nc0)),full1)"
    with forced_split(split):
        launch.gemm(a, b, [nc, full], sig, out)
    ref = reference((a.double() @ b.double()).view(3, 7, 26), epi.parse(sig), [nc, full], -1)
    assert_close(epi.rows3(out, out.shape, -1), ref, torch.float32)
    via_op = torch.ops.resfuse.gemm(a, b, [nc, full], sig, [3, 7, 26], "triton")
    assert_close(epi.rows3(via_op, via_op.shape, -1), ref, torch.float32)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), m=st.integers(1, 70), n8=st.integers(1, 9),
       k8=st.integers(1, 11), b_cm=st.booleans(), split=st.sampled_from([1, 2, 3, 5]),
       tile=st.sampled_from([(16, 16, 16), (32, 16, 32), (16, 32, 16)]), persistent=st.sampled_from([0, 1, 2]))
def test_tma_mainloop_epilogues(data, dtype, m, n8, k8, b_cm, split, tile, persistent):
    """The TMA-descriptor mainloop (2-D A and B, row strides 16-byte aligned: N and K multiples of 8 here, M
    free); boxes past the edges read zeros. B is [K, N] or a linear layer's transposed [N, K] weight.
    persistent > 0: the persistent kernel, whose 1 or 2 programs (one SM under the interpreter) walk every tile."""
    n, k = 8 * n8, 8 * k8
    tree, roles = data.draw(trees(kinds=("c", "full"), aux=True))
    a = torch.randn(m, k).to(dtype)
    b = _matrix([k, n], dtype, b_cm) / k ** 0.5
    assert launch.tma_operands(a, b)[1] == (not b_cm)  # the descriptor path, with B's orientation
    layouts = [data.draw(st.sampled_from([0, 1, 2])) for _ in roles]  # contiguous, column-major, strided
    operands = [make_operand(role, kind, [m, n], -1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    pad = data.draw(st.sampled_from([0, 8]))  # rows padded: the bulk store must clip at the matrix's columns
    storage = torch.full((m, n + pad), float("nan"), dtype=dtype)
    out = storage[:, :n]
    bulk = data.draw(st.booleans()) and (persistent or split == 1)  # a bulk output store
    cfg = launch.GemmConfig(*tile, group_m=2, split_k=1 if persistent else split, num_warps=4, num_stages=2,
                            tma=True, ws=not persistent and data.draw(st.booleans()), persistent=persistent,
                            tma_store=bulk)
    assert cfg.check(GemmProblem(1, m, n, k, a.element_size(), 1))
    aux = poisoned_aux(tree, out)
    launch.gemm(a, b, operands, str(tree), out, cfg, aux)
    slots = descriptor_slots(tree, operands, [m, n], -1, cfg.split_k)
    assert slots or not any(k == "full" and lay == 0 and dtype != torch.float32 and cfg.split_k == 1
                            for (k, _), lay in zip(roles, layouts))  # contiguous rows of 8k elements: descriptors
    family = "gemm_tma_persistent" if persistent else "gemm_tma"
    out_tma = output_descriptor(out, -1, cfg.split_k) and cfg.tma_store
    assert out_tma == (dtype != torch.float32 and cfg.split_k == 1 and cfg.tma_store)  # 16-byte rows: n = 8 n8
    assert (family, codegen.variant(str(tree), slots, out_tma)) in codegen._LOADED  # not the pointer fallback
    acc = torch.matmul(a.double(), b.double())
    assert_close(epi.rows3(out, out.shape, -1), reference(acc, tree, operands, -1), dtype)
    assert torch.isnan(storage[:, n:]).all(), "wrote outside the output view"
    check_aux(aux, acc, tree, operands, -1, dtype)


def test_tma_config_falls_back_to_pointers_where_descriptors_cannot_read():
    """A row stride that is not 16-byte aligned (K = 5 in fp32), or a batched product: the pointer mainloop."""
    a, b = torch.randn(9, 5), torch.randn(5, 8)
    assert launch.tma_operands(a, b) is None and launch.tma_operands(torch.randn(2, 9, 8), torch.randn(8, 8)) is None
    out = torch.full((9, 8), float("nan"))
    launch.gemm(a, b, [], "relu(acc)", out, launch.GemmConfig(16, 16, 16, 2, 1, 4, 2, tma=True))
    torch.testing.assert_close(out.double(), torch.relu(a.double() @ b.double()), rtol=1e-4, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), m=st.integers(1, 70), c=st.integers(1, 40),
       k8=st.integers(1, 9), split=st.sampled_from([1, 1, 2, 3]),
       mainloop=st.sampled_from(["pointer", "tma", "persistent"]),
       tile=st.sampled_from([(16, 16, 16), (32, 32, 16), (16, 64, 32)]), rows3=st.booleans())
def test_glu_epilogues_pair_the_products_columns(data, dtype, m, c, k8, split, mainloop, tile, rows3):
    """A GLU's epilogue (epilogue.paired): the product has 2C columns, gate and up interleaved, and the output C;
    output channel j is f(act(acc[:, 2j]), acc[:, 2j + 1]) and the rest of the tree, on every mainloop, split or
    not, for channel counts that are not multiples of the half tile, into an [M, C] or [B, S, C] output."""
    k = 8 * k8  # 16-byte rows for the TMA mainloops
    if mainloop != "pointer" and dtype == torch.float32 and c % 2:
        c += 1  # the interleaved weight's rows (2C fp32) are 16-byte aligned
    tree, roles = data.draw(trees(kinds=("c", "full"), max_steps=2))
    gate = data.draw(st.sampled_from(["silu", "gelu", "gelu_tanh", "relu", "sigmoid", "tanh"]))
    tree = glu(tree, gate, data.draw(st.booleans()))
    a = torch.randn(m, k).to(dtype)
    b = (torch.randn(2 * c, k) / k ** 0.5).to(dtype).t()  # a linear layer's weight, transposed
    samples = 1 if not rows3 else next(s for s in (3, 2, 1) if m % s == 0)
    out_shape = [samples, m // samples, c] if rows3 else [m, c]
    operands = [make_operand(role, kind, out_shape, -1, dtype, data.draw(st.sampled_from([0, 1, 2])))
                for kind, role in roles]
    out = torch.full(out_shape, float("nan"), dtype=dtype)
    cfg = launch.GemmConfig(*tile, group_m=2, split_k=1 if mainloop == "persistent" else split, num_warps=4,
                            num_stages=2, tma=mainloop != "pointer", persistent=2 * (mainloop == "persistent"),
                            tma_store=data.draw(st.booleans()))  # asked for, never used: the tile is half wide
    launch.gemm(a, b, operands, str(tree), out, cfg)
    acc = torch.matmul(a.double(), b.double()).view([*out_shape[:-1], 2 * c])
    ref = reference(acc, tree, operands, -1)
    assert ref.shape[-1] == c
    assert_close(epi.rows3(out, out.shape, -1), ref, dtype)
    via_op = torch.ops.resfuse.gemm(a, b, operands, str(tree), out_shape, "triton")  # the op, and its reference
    assert_close(epi.rows3(via_op, via_op.shape, -1), ref, dtype)
    cpu = torch.ops.resfuse.gemm(a, b, operands, str(tree), out_shape, "aten")
    assert_close(epi.rows3(cpu, cpu.shape, -1), ref, dtype)


def test_a_glu_epilogue_refuses_a_swapped_tile_and_an_odd_product():
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    with pytest.raises(NotImplementedError, match="swapped"):
        launch.gemm(a, b, [], "mul(silu(acc),up)", torch.empty(4, 3),
                    launch.GemmConfig(16, 16, 16, 2, 1, 4, 2, swap=True))
    with pytest.raises(ValueError, match="do not fit"):
        launch.gemm(a, torch.randn(8, 5), [], "mul(silu(acc),up)", torch.empty(4, 3))
