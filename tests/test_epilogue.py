"""The epilogue IR: signature round trip, pattern names, and the reference math against plain torch."""
import math
import re

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse.kernels.epilogue_source import triton_body

UNARY = [n for n, s in epi.OPS.items() if s.arity == 1]
PARAMS = {"clamp": (-0.5, 6.0), "leaky_relu": (0.2,)}


@st.composite
def trees(draw, depth=4):
    tree, slot = epi.ACC, 0
    for _ in range(draw(st.integers(0, depth))):
        kind = draw(st.sampled_from(["unary", "binary", "bn"]))
        if kind == "unary":
            name = draw(st.sampled_from(UNARY))
            tree = epi.Op(name, (tree,), PARAMS.get(name, ()))
        elif kind == "bn":
            tree = epi.Op("bn", (tree, *[epi.Operand(slot + i, "c") for i in range(4)]), (1e-5,))
            slot += 4
        else:
            leaf = draw(st.one_of(st.builds(epi.Const, st.floats(-4, 4, allow_nan=False)),
                                  st.sampled_from(["c", "nc", "full"]).map(lambda k: epi.Operand(slot, k))))
            slot += isinstance(leaf, epi.Operand)
            args = (tree, leaf) if draw(st.booleans()) else (leaf, tree)
            tree = epi.Op(draw(st.sampled_from(["add", "sub", "mul"])), args)
    return tree


@settings(max_examples=200, deadline=None)
@given(trees())
def test_signature_round_trips(tree):
    assert epi.parse(str(tree)) == tree
    assert len(epi.pattern_ops(tree)) == str(tree).count("(")


@settings(max_examples=100, deadline=None)
@given(trees(), trees(), st.dictionaries(st.sampled_from(UNARY), st.integers(1, 3)))
def test_op_versions_name_each_versioned_op_of_a_signature_or_pair(first, second, versions):
    """The tuning key's op tag (epilogue.op_versions) lists every versioned op that a signature, or a pair's
    'sig1;sig2', holds, with its version, and no other."""
    import dataclasses

    table = {n: dataclasses.replace(s, version=versions.get(n, 0)) for n, s in epi.OPS.items()}
    saved = dict(epi.OPS)
    epi.OPS.update(table)
    try:
        for signature in (str(first), f"{first};{second}"):
            held = {n for n in versions if re.search(rf"(^|[(,;]){n}[(\[]", signature)}
            assert epi.op_versions(signature) == "".join(f"+{n}{versions[n]}" for n in sorted(held))
    finally:
        epi.OPS.update(saved)


def test_pattern_names():
    tree = epi.Op("relu", (epi.Op("add", (epi.Op("bn", (epi.ACC, *[epi.Operand(i, "c") for i in range(4)]),
                                                 (1e-5,)), epi.Operand(4, "full"))),))
    assert epi.pattern_ops(tree) == ["bn", "add", "relu"]
    assert epi.pattern_ops(epi.Op("clamp", (epi.Op("add", (epi.ACC, epi.Operand(0, "c"))),), (0.0, 6.0))) == [
        "bias", "relu6"]
    assert epi.full_adds(tree) == 1


def test_aux_node_marks_the_saved_value():
    inner = epi.Op("add", (epi.ACC, epi.Operand(0, "c")))
    tree = epi.Op("gelu", (epi.Op("aux", (inner,)),))
    assert epi.parse(str(tree)) == tree and str(tree) == "gelu(aux(add(acc,c0)))"
    assert epi.pattern_ops(tree) == ["bias", "save", "gelu"]
    assert epi.aux_value(tree) == inner and epi.aux_value(inner) is None
    body = triton_body(tree)
    assert "aux_y = t0" in body and body.strip().endswith("y = t1")
    from resfuse.passes.report import bytes_saved

    out = torch.empty(4, 8)
    # unfused: acc written, bias read + written, gelu read + written (5N); fused: out and aux written (2N)
    assert bytes_saved(tree, out) == 3 * out.numel() * 4
    assert bytes_saved(epi.Op("gelu", (inner,)), out) == 4 * out.numel() * 4


TORCH = {"relu": torch.relu, "clamp": lambda x: torch.clamp(x, -0.5, 6.0), "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
         "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
         "sigmoid": torch.sigmoid, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "tanh": torch.tanh,
         "float32": lambda x: x, "aux": lambda x: x}


def test_reference_matches_torch_for_every_unary_op():
    assert set(TORCH) == set(UNARY)
    acc = torch.randn(2, 5, 3, dtype=torch.float64) * 4
    for name, fn in TORCH.items():
        out = epi.reference(epi.Op(name, (epi.ACC,), PARAMS.get(name, ())), acc, [])
        torch.testing.assert_close(out, fn(acc))


def test_operand_views_put_1d_vectors_on_the_channel_dim():
    tree = epi.Op("add", (epi.ACC, epi.Operand(0, "c")))
    bias = torch.arange(4.0)
    (v,) = epi.operand_views(tree, [bias], (2, 4, 3, 3), 1)
    assert v.shape == (2, 9, 4) and v.stride() == (0, 0, 1)
    out = torch.zeros(2, 4, 3, 3)
    ref = epi.reference(tree, epi.rows3(out, out.shape, 1), [v])
    assert torch.equal(ref[0, 0], bias)
    assert epi.operand_kind(epi.rows3(torch.ones(2, 4, 1, 1), (2, 4, 3, 3), 1)) == "nc"
    assert epi.operand_kind(epi.rows3(torch.ones(2, 4, 3, 3), (2, 4, 3, 3), 1)) == "full"
    assert math.isnan(epi.reference(epi.Op("relu", (epi.ACC,)), torch.tensor([[[math.nan]]]), []).item())


def test_threshold_bwd_is_atens_relu_gradient():
    g = torch.randn(2, 5, 3, dtype=torch.float64)
    y = torch.randn(2, 5, 3, dtype=torch.float64)
    y[0, 0, 0], g[1, 1, 1] = float("nan"), float("nan")
    tree = epi.parse("threshold_bwd[#0.0](acc,full0)")
    assert epi.pattern_ops(tree) == ["drelu"]
    torch.testing.assert_close(epi.reference(tree, g, [y]), torch.ops.aten.threshold_backward(g, y, 0.0),
                               equal_nan=True)
