"""The stem probe kernel (bench/stem_kernel.py: conv + epilogue + max-pool in one kernel; a probe that no pass
uses, since it measured slower than resfuse's path) under the interpreter, against the unfused float64
computation: random small-channel convs and pools, ragged tiles, both pooling variants, both reduction orders, the box computed in one
block or two, channel tiles narrower than the output's channels, and random epilogues over per-channel and per-(sample, channel) operands; outputs are
NaN-poisoned first."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from resfuse import epilogue as epi

from .epilogues import assert_close, make_operand, trees, with_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import stem_kernel  # noqa: E402  (the generated kernel imports it by this name, from bench/)


@st.composite
def problems(draw):
    r, s = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    conv = ([draw(st.integers(1, 2))] * 2, [draw(st.integers(0, r // 2)), draw(st.integers(0, s // 2))], [1, 1])
    kh, kw = draw(st.integers(2, 3)), draw(st.integers(2, 3))
    pool = ([kh, kw], [draw(st.integers(1, 2)), draw(st.integers(1, 2))],
            [draw(st.integers(0, kh // 2)), draw(st.integers(0, kw // 2))], [1, 1], False)
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(r + 4, 30)),
             draw(st.integers(s + 4, 30)))
    k = draw(st.sampled_from([5, 16, 40]))
    gather = draw(st.booleans())
    config = stem_kernel.PoolConfig(tile_h=draw(st.sampled_from([1, 3, 4])), tile_w=draw(st.sampled_from([2, 5])),
                                    block_n=draw(st.sampled_from([16, 32])), block_k=draw(st.sampled_from([16, 32])),
                                    num_warps=4, gather=gather, programs=draw(st.integers(1, 2)),
                                    splits=1 if gather else draw(st.sampled_from([1, 2])), rows=draw(st.booleans()))
    assume(config.check(pool))
    return shape, k, (r, s), conv, pool, config


@settings(max_examples=25, deadline=None)
@given(problem=problems(), epilogue=trees(kinds=("c", "nc"), max_steps=3),
       dtype=st.sampled_from([torch.float16, torch.float32]), layout=st.sampled_from(["channels_last", "contiguous"]))
def test_conv_epilogue_pool_matches_float64(problem, epilogue, dtype, layout):
    shape, k, (r, s), conv, pool, config = problem
    tree, roles = epilogue
    x = with_layout(torch.randn(shape).to(dtype), layout)
    w = with_layout((torch.randn(k, shape[1], r, s) / (r * s * shape[1]) ** 0.5).to(dtype), layout)
    conv64 = F.conv2d(x.double(), w.double(), None, *conv)
    operands = [make_operand(role, kind, conv64.shape, 1, dtype) for kind, role in roles]
    acc3 = epi.rows3(conv64, conv64.shape, 1)
    ops3 = [epi.rows3(t.double(), conv64.shape, 1) for t in operands]
    y64 = epi.reference(tree, acc3, ops3).reshape(conv64.shape[0], -1, k).transpose(1, 2).reshape(conv64.shape)
    ref = F.max_pool2d(y64, *pool[:4])
    out = with_layout(torch.full(ref.shape, float("nan"), dtype=dtype), layout)
    stem_kernel.conv2d_max_pool(x, w, operands, str(tree), *conv, pool, out, config)
    assert_close(epi.rows3(out, out.shape, 1), epi.rows3(ref, ref.shape, 1), dtype)


def test_resnet_stem_shape_and_tile_edges():
    """ResNet's stem geometry (7x7 s2 p3, 3x3 s2 p1 pool) on an image whose pooled size is no multiple of the
    default 7x7 tile, so edge tiles, interior tiles and pool padding all occur."""
    x = torch.randn(1, 3, 70, 62).half().contiguous(memory_format=torch.channels_last)
    w = (torch.randn(64, 3, 7, 7) * 0.1).half().contiguous(memory_format=torch.channels_last)
    m, v, g, b = torch.randn(64).half(), (torch.rand(64) + 0.5).half(), torch.randn(64).half(), torch.randn(64).half()
    ref = F.max_pool2d(F.relu(F.batch_norm(F.conv2d(x.double(), w.double(), None, 2, 3), m.double(), v.double(),
                                           g.double(), b.double(), False, 0.0, 1e-5)), 3, 2, 1)
    for config in (stem_kernel.PoolConfig(), stem_kernel.PoolConfig(splits=4, tile_w=15)):
        out = torch.full(ref.shape, float("nan")).half().contiguous(memory_format=torch.channels_last)
        stem_kernel.conv2d_max_pool(x, w, [m, v, g, b], "relu(bn[#1e-05](acc,c0,c1,c2,c3))", [2, 2], [3, 3], [1, 1],
                                    ([3, 3], [2, 2], [1, 1], [1, 1], False), out, config)
        assert_close(epi.rows3(out, out.shape, 1), epi.rows3(ref, ref.shape, 1), torch.float16)


def test_packed_weight_is_never_another_tensors():
    """The packed-weight cache is keyed by address: a new weight at a freed one's address (which the allocator
    hands out again) must be packed anew, not served the old one's packing (a flaky failure once)."""
    w = torch.randn(8, 3, 7, 7).half()
    stem_kernel._packed(w, 32)
    address = w.data_ptr()
    del w
    for _ in range(20):
        w = torch.randn(8, 3, 7, 7).half()
        if w.data_ptr() == address:
            break
    expected = torch.zeros(7, 32, 8).half()
    expected[:, :21] = w.permute(2, 3, 1, 0).reshape(7, 21, 8)
    assert torch.equal(stem_kernel._packed(w, 32), expected)
    w.add_(1.0)  # an in-place update is packed anew too
    expected[:, :21] += 1.0
    assert torch.equal(stem_kernel._packed(w, 32), expected)
