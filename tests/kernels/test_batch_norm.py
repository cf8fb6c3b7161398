"""Training batch norm + epilogue under the interpreter: y, save_mean, save_invstd and the new running stats against
aten's functional batch norm in float64 followed by the epilogue in float64; layouts, ragged shapes, None
arguments, NaN/Inf, determinism, and a mean far from 0."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resfuse import epilogue as epi
from resfuse import kernels, ops
from resfuse.kernels import batch_norm
from resfuse.kernels.batch_norm import BnConfig

from .epilogues import assert_close, make_operand, reference, trees, with_layout

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATEN = torch.ops.aten._native_batch_norm_legit_functional
# Small tiles and several row splits, so tiny shapes still cross tile, split and channel-block edges.
CONFIGS = [None, BnConfig(4, 2, 3, 2), BnConfig(16, 4, 2, 1), BnConfig(2, 8, 5, 4), BnConfig(8, 16, 4, 4)]



def _inputs(shape, dtype, layout, affine=True, running=True, param_dtype=torch.float32, mean=0.0):
    c = shape[1]
    x = with_layout((torch.randn(shape) * 2 + mean).to(dtype), layout)
    w = (torch.rand(c) + 0.5).to(param_dtype) if affine else None
    b = torch.randn(c).to(param_dtype) if affine else None
    rm = torch.randn(c).to(param_dtype) if running else None
    rv = (torch.rand(c) + 0.5).to(param_dtype) if running else None
    return x, w, b, rm, rv


def _dbl(t):
    return None if t is None else t.double()


def _aten64(x, w, b, rm, rv, momentum, eps):
    """aten's functional batch norm in float64 (zero / unit running stats stand in for None ones)."""
    c = x.shape[1]
    rm64 = _dbl(rm) if rm is not None else torch.zeros(c, dtype=torch.float64)
    rv64 = _dbl(rv) if rv is not None else torch.ones(c, dtype=torch.float64)
    return ATEN(x.double(), _dbl(w), _dbl(b), rm64, rv64, True, momentum, eps)


def _run(x, w, b, rm, rv, operands, signature, momentum=0.1, eps=1e-5, use_out=False, config=None, sums=False):
    out = torch.full_like(x, float("nan")) if use_out else None  # poisoned: every element must be written
    res = kernels.batch_norm_train(x, w, b, rm, rv, operands, signature, momentum, eps, out=out, config=config,
                                   sums=_sums(x) if sums else None)
    if use_out:
        assert res[0] is out
    return res


def _sums(x):
    """fp32 sum(x) and sum(x * x) per channel, as ops.conv2d_stats's reference path gives them (cuDNN's genstats
    sums in fp32 too)."""
    xf = x.float().transpose(0, 1).reshape(x.shape[1], -1)
    return torch.stack([xf.sum(1), (xf * xf).sum(1)])


def _check(res, x, w, b, rm, rv, tree, operands, momentum=0.1, eps=1e-5):
    y, mean, invstd, rm_new, rv_new = res
    y64, mean64, invstd64, rm64, rv64 = _aten64(x, w, b, rm, rv, momentum, eps)
    assert y.dtype == x.dtype and y.shape == x.shape and y.stride() == torch.empty_like(x).stride()
    assert mean.dtype == invstd.dtype == torch.float32
    ref = reference(y64, tree, operands, 1)
    assert_close(epi.rows3(y, y.shape, 1), ref, x.dtype, slack=2 * _eager_error(x, w, b, rm, rv, momentum, eps,
                                                                                   tree, operands, ref))
    assert_close(mean, mean64, torch.float32)
    assert_close(invstd, invstd64, torch.float32)
    if rm is None:
        assert rm_new is None and rv_new is None
        return
    assert rm_new.dtype == rm.dtype and rv_new.dtype == rv.dtype
    assert_close(rm_new, rm64, rm.dtype)
    if x.numel() // x.shape[1] > 1:
        assert_close(rv_new, rv64, rv.dtype)
    else:  # one value per channel: the unbiased variance is 0/0, as aten's
        assert torch.isnan(rv_new).all() and torch.isnan(rv64).all()


def _eager_error(x, w, b, rm, rv, momentum, eps, tree, operands, ref) -> float:
    """The largest error of eager's fp32 batch norm (then the epilogue in float64) against the float64 reference.
    Where a channel's mean is far from 0 against its spread (1000 + N(0, 4) over 3 values), the fp32 mean's own
    rounding costs the normalized values more than the dtype's tolerance, in eager as in ours: ATen measured
    5.9e-4 on such inputs, ours 1.6e-4, against a tolerance of 1e-4."""
    c = x.shape[1]
    rm32 = rm.float() if rm is not None else torch.zeros(c)
    rv32 = rv.float() if rv is not None else torch.ones(c)
    y32 = ATEN(x.float(), None if w is None else w.float(), None if b is None else b.float(), rm32, rv32, True,
               momentum, eps)[0]
    return float((reference(y32.double(), tree, operands, 1) - ref).abs().max())


SHAPES = st.one_of(
    st.tuples(st.integers(1, 9), st.sampled_from([1, 3, 5, 17])),  # [N, C]
    st.tuples(st.integers(1, 3), st.sampled_from([1, 3, 5, 17]), st.sampled_from([1, 7])),  # [N, C, L]
    st.tuples(st.integers(1, 3), st.sampled_from([1, 3, 5, 17]), st.sampled_from([1, 3, 9]), st.sampled_from([1, 3, 9])),
)


@settings(max_examples=50, deadline=None)
@given(data=st.data(), shape=SHAPES, dtype=st.sampled_from(DTYPES),
       layout=st.sampled_from(["contiguous", "channels_last", "strided"]), affine=st.booleans(),
       running=st.booleans(), same_param_dtype=st.booleans(), use_out=st.booleans(), config=st.sampled_from(CONFIGS),
       momentum=st.sampled_from([0.1, 0.0, 1.0]))
def test_matches_aten_then_epilogue(data, shape, dtype, layout, affine, running, same_param_dtype, use_out, config,
                                    momentum):
    tree, roles = data.draw(trees(kinds=("c", "nc", "full") if len(shape) > 2 else ("c", "full")))  # [N, C]: nc is full
    param_dtype = dtype if same_param_dtype else torch.float32
    x, w, b, rm, rv = _inputs(shape, dtype, layout, affine, running, param_dtype)
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    operands = [make_operand(role, kind, shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]
    before = [t.clone() for t in (x, rm, rv) if t is not None]
    res = _run(x, w, b, rm, rv, operands, str(tree), momentum, use_out=use_out, config=config)
    assert all(torch.equal(t, u) for t, u in zip(before, [t for t in (x, rm, rv) if t is not None])), \
        "an input was written"
    _check(res, x, w, b, rm, rv, tree, operands, momentum)


@settings(max_examples=25, deadline=None)
@given(shape=SHAPES, dtype=st.sampled_from(DTYPES), layout=st.sampled_from(["contiguous", "channels_last", "strided"]),
       affine=st.booleans(), running=st.booleans(), config=st.sampled_from(CONFIGS))
def test_statistics_alone_then_a_folded_shortcut(shape, dtype, layout, affine, running, config):
    """batch_norm_stats: the statistics and running stats of batch_norm_train, and the scale and shift with which
    another batch norm's epilogue normalizes x: relu(bn(main) + normalize(x)) equals the two batch norms in
    float64 (passes/shortcut_bn.py's fold)."""
    x, w, b, rm, rv = _inputs(shape, dtype, layout, affine, running)
    mean, invstd, rm_new, rv_new, (scale, shift) = kernels.batch_norm_stats(x, w, b, rm, rv, 0.1, 1e-5, config)
    y64, mean64, invstd64, rm64, rv64 = _aten64(x, w, b, rm, rv, 0.1, 1e-5)
    assert scale.dtype == shift.dtype == torch.float32 and scale.shape == shift.shape == (shape[1],)
    _check((torch.empty_like(x).copy_(y64), mean, invstd, rm_new, rv_new), x, w, b, rm, rv, epi.ACC, [])  # y: aten's
    assert_close(scale, invstd64 * (_dbl(w) if w is not None else 1.0), torch.float32)
    assert_close(shift, _dbl(b) if b is not None else torch.zeros(shape[1], dtype=torch.float64), torch.float32)
    main, mw, mb, mrm, mrv = _inputs(shape, dtype, layout, affine, running)
    tree = epi.parse("relu(add(acc,normalize(full0,c1,c2,c3)))")
    y = _run(main, mw, mb, mrm, mrv, [x, mean, scale, shift], str(tree), use_out=True, config=config)[0]
    want = torch.relu(_aten64(main, mw, mb, mrm, mrv, 0.1, 1e-5)[0] + y64)
    assert_close(epi.rows3(y, y.shape, 1), epi.rows3(want, want.shape, 1), dtype)


@pytest.mark.parametrize("provider", ["triton", "reference"])
def test_statistics_op_outputs_alias_nothing(provider):
    """A custom op's outputs may alias no input and no other output: torch checks it on a compiled graph's first
    call through the dispatcher (an error under its CI setting, a deprecation warning elsewhere)."""
    x, w, b, rm, rv = _inputs((4, 6, 3, 3), torch.float32, "channels_last", True, True)
    out = ops.batch_norm_stats(x, w, b, rm, rv, 0.1, 1e-5, provider)
    torch._library.utils._c_check_aliasing_constraint("batch_norm_stats", (x, w, b, rm, rv), {}, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, BnConfig(4, 2, 3, 2)])
def test_resnet_bottleneck_tail(dtype, config):
    """bn -> add(residual) -> relu, channels_last: the tail of every ResNet bottleneck."""
    torch.manual_seed(0)
    shape = (2, 17, 7, 7)
    x, w, b, rm, rv = _inputs(shape, dtype, "channels_last")
    res_ = make_operand("any", "full", shape, 1, dtype, 1)
    tree = epi.parse("relu(add(acc,full0))")
    out = _run(x, w, b, rm, rv, [res_], str(tree), use_out=True, config=config)
    _check(out, x, w, b, rm, rv, tree, [res_])
    assert (out[0] >= 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_far_from_zero_keeps_the_variance(dtype):
    # x = 1000 + N(0, 2^2): E[x^2] - E[x]^2 in fp32 loses the variance to rounding of E[x^2] ~ 1e6
    torch.manual_seed(1)
    shape = (4, 5, 9, 9)
    for layout, config in [("channels_last", BnConfig(16, 4, 3, 2)), ("contiguous", None)]:
        x, w, b, rm, rv = _inputs(shape, dtype, layout, mean=1000.0)
        tree = epi.parse("acc")
        res = _run(x, w, b, rm, rv, [], "acc", config=config)
        _check(res, x, w, b, rm, rv, tree, [])
        var64 = x.double().var(dim=(0, 2, 3), unbiased=False)
        torch.testing.assert_close(res[2].double(), (var64 + 1e-5).rsqrt(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("config", [None, BnConfig(16, 4, 3, 2), BnConfig(4, 2, 5, 4)])
def test_fp32_statistics_are_rounded_like_eager_s(config):
    """fp32 save_invstd within 1.5 ulp of float64's, though each split's first row lies 4 deviations off the mean
    (as a pivot, such a row cost 11 ulp: sum(d^2) - sum(d)^2 / n cancelled)."""
    torch.manual_seed(6)
    x = 0.1 + 0.1 * torch.randn(3, 6, 8, 8)
    x = torch.where(torch.rand(3, 1, 8, 8) < 0.2, 0.5, x).contiguous(memory_format=torch.channels_last)  # 1 row in 5
    res = _run(x, None, None, None, None, [], "acc", config=config)
    want = (x.double().var(dim=(0, 2, 3), unbiased=False) + 1e-5).rsqrt()
    assert ((res[2].double() - want).abs() / want).max() < 1.5 * 2.0 ** -24 * 2


@pytest.mark.parametrize("shape", [(1, 3, 1, 1), (1, 4), (1, 2, 1)])
def test_one_value_per_channel(shape):
    """N*H*W = 1: y is the bias, save_invstd is 1/sqrt(eps), and running_var is NaN (0/0), as aten."""
    x, w, b, rm, rv = _inputs(shape, torch.float32, "contiguous")
    y, mean, invstd, rm_new, rv_new = _run(x, w, b, rm, rv, [], "acc", use_out=True)
    ref = _aten64(x, w, b, rm, rv, 0.1, 1e-5)
    assert torch.isnan(ref[4]).all() and torch.isnan(rv_new).all()
    torch.testing.assert_close(y.double(), ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(invstd.double(), ref[2], rtol=1e-5, atol=0)
    torch.testing.assert_close(rm_new.double(), ref[3], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mean, x.reshape(-1), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_weight_bias_and_running_stats_may_be_none(layout):
    torch.manual_seed(2)
    x, *_ = _inputs((3, 5, 3, 3), torch.float16, layout)
    y, mean, invstd, rm_new, rv_new = _run(x, None, None, None, None, [], "relu(acc)")
    assert rm_new is None and rv_new is None
    ref = torch.ops.aten._native_batch_norm_legit.no_stats(x.double(), None, None, True, 0.1, 1e-5)
    assert_close(y, torch.relu(ref[0]), torch.float16)
    assert_close(mean, ref[1], torch.float32)
    assert_close(invstd, ref[2], torch.float32)


@pytest.mark.parametrize("config", [None, BnConfig(4, 2, 3, 2)])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_nan_and_inf_propagate_like_eager(config, layout):
    torch.manual_seed(3)
    shape = (2, 5, 4, 3)
    x, w, b, rm, rv = _inputs(shape, torch.float32, layout)
    x[1, 0, 2, 1] = float("nan")
    x[0, 1, 3, 2] = float("inf")
    x[1, 3, 0, 0] = float("-inf")
    res_ = make_operand("any", "full", shape, 1, x.dtype, 1)
    y, mean, invstd, rm_new, rv_new = _run(x, w, b, rm, rv, [res_], "relu(add(acc,full0))", config=config)
    ref = _aten64(x, w, b, rm, rv, 0.1, 1e-5)
    y_ref = torch.relu(ref[0] + res_.double())
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref)) and torch.isnan(y_ref[:, [0, 1, 3]]).all()
    finite = torch.isfinite(y_ref)
    torch.testing.assert_close(y.double()[finite], y_ref[finite], rtol=1e-4, atol=1e-4)
    for got, want in zip((mean, invstd, rm_new, rv_new), ref[1:]):
        # eager's plain-sum mean of a channel holding Inf is +-Inf; ours (a Welford-style merge) is NaN, as CUDA's
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        assert torch.equal(torch.isnan(got) | torch.isinf(want), torch.isnan(want) | torch.isinf(want))
        torch.testing.assert_close(got.double()[torch.isfinite(want)], want[torch.isfinite(want)],
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config", [None, BnConfig(4, 2, 3, 2), BnConfig(8, 4, 7, 4)])
def test_bit_identical_across_runs(config):
    torch.manual_seed(4)
    shape = (3, 6, 5, 5)
    x, w, b, rm, rv = _inputs(shape, torch.float16, "channels_last", mean=3.0)
    res_ = make_operand("any", "full", shape, 1, x.dtype, 0)
    first = _run(x, w, b, rm, rv, [res_], "relu(add(acc,full0))", config=config)
    # another shape in between leaves the shared workspace dirty
    _run(*_inputs((2, 9), torch.float32, "contiguous"), [], "acc", config=config)
    second = _run(x, w, b, rm, rv, [res_], "relu(add(acc,full0))", config=config)
    for a, b_ in zip(first, second):
        assert torch.equal(a, b_)


def test_plans_are_cached_and_odd_strides_are_copied():
    x = torch.randn(2, 3, 5, 4).transpose(2, 3)  # H and W swapped: no [S, P, C] view, read through a copy
    w, b = torch.rand(3) + 0.5, torch.randn(3)
    before = len(batch_norm._PLANS)
    for _ in range(2):
        y, *_ = _run(x, w, b, None, None, [], "acc")
    assert len(batch_norm._PLANS) == before + 1
    ref = _aten64(x, w, b, None, None, 0.1, 1e-5)[0]
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4)


def test_bad_arguments_are_refused():
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(RuntimeError):
        kernels.batch_norm_train(torch.randn(0, 3, 2, 2), None, None, None, None, [], "acc", 0.1, 1e-5)
    with pytest.raises(ValueError):
        kernels.batch_norm_train(x, torch.ones(4), None, None, None, [], "acc", 0.1, 1e-5)
    with pytest.raises(ValueError):
        kernels.batch_norm_train(x, None, None, torch.zeros(3), None, [], "acc", 0.1, 1e-5)
    with pytest.raises(TypeError):
        kernels.batch_norm_train(x.double(), None, None, None, None, [], "acc", 0.1, 1e-5)


# ---- given sums (a conv's genstats): the statistics without their pass over x --------------------------------------
@settings(max_examples=40, deadline=None)
@given(data=st.data(), shape=SHAPES, dtype=st.sampled_from(DTYPES),
       layout=st.sampled_from(["contiguous", "channels_last", "strided"]), affine=st.booleans(),
       running=st.booleans(), config=st.sampled_from(CONFIGS), mean=st.sampled_from([0.0, 3.0, 1000.0]),
       stats_alone=st.booleans())
def test_given_sums_match_aten_then_epilogue(data, shape, dtype, layout, affine, running, config, mean, stats_alone):
    """From fp32 sums, mean far from 0 or not (1000: sum(x^2) - sum(x)^2 / n keeps no bit of the variance, and
    the finalize kernel's exact pass over x must run), as batch_norm_train and as batch_norm_stats."""
    x, w, b, rm, rv = _inputs(shape, dtype, layout, affine, running, mean=mean)
    if stats_alone:
        got = kernels.batch_norm_stats(x, w, b, rm, rv, 0.1, 1e-5, config=config, sums=_sums(x))
        want = kernels.batch_norm_stats(x, w, b, rm, rv, 0.1, 1e-5, config=config)
        ref = _aten64(x, w, b, rm, rv, 0.1, 1e-5)
        for g, v in zip(got[:2], ref[1:3]):
            assert_close(g, v, torch.float32)
        for g, v in zip(got[2:], want[2:]):
            assert (g is None) == (v is None)
            assert g is None or torch.allclose(g.double(), v.double(), rtol=1e-4, equal_nan=True)
        return
    tree, roles = data.draw(trees(kinds=("c", "nc", "full") if len(shape) > 2 else ("c", "full")))
    operands = [make_operand(role, kind, shape, 1, dtype, 0) for kind, role in roles]
    res = _run(x, w, b, rm, rv, operands, str(tree), use_out=True, config=config, sums=True)
    _check(res, x, w, b, rm, rv, tree, operands)


@pytest.mark.parametrize("config", [None, BnConfig(4, 2, 3, 2)])
def test_given_sums_recompute_only_the_channels_that_cancelled(config):
    """Channels 0 and 3 sit at 1000 + N(0, 1), the others near 0: the sums give the others their variance as they
    are (their fp32 rounding, not the exact pass's), and the exact pass fixes 0 and 3 to fp32's own precision."""
    torch.manual_seed(7)
    x = torch.randn(3, 5, 6, 6) + torch.tensor([1000.0, 0, 0.5, 1000, -1]).view(1, 5, 1, 1)
    sums = _sums(x)
    sums[0, [0, 3]] += 5.0  # an error of 1e-5 in sum(x), as a conv's fp32 sums may carry: the exact pass mends the mean
    y, mean, invstd, *_ = kernels.batch_norm_train(x, None, None, None, None, [], "acc", 0.1, 1e-5, config=config,
                                                   sums=sums)
    var64 = x.double().var(dim=(0, 2, 3), unbiased=False)
    torch.testing.assert_close(invstd.double(), (var64 + 1e-5).rsqrt(), rtol=1e-5, atol=0)
    n = x.numel() // 5
    naive = (sums[1] - sums[0] * (sums[0] / n)).clamp_min(0) / n  # what the sums alone give
    assert ((naive.double() - var64).abs() / var64)[[0, 3]].min() > 1e-2  # ... is far off where the mean is large
    torch.testing.assert_close(mean.double(), x.double().mean((0, 2, 3)), rtol=1e-6, atol=1e-6)


def test_given_sums_propagate_nan_like_eager():
    torch.manual_seed(3)
    x, w, b, rm, rv = _inputs((2, 5, 4, 3), torch.float32, "channels_last")
    x[1, 0, 2, 1] = float("nan")
    x[0, 1, 3, 2] = float("inf")
    y, mean, invstd, rm_new, rv_new = _run(x, w, b, rm, rv, [], "acc", sums=True)
    ref = _aten64(x, w, b, rm, rv, 0.1, 1e-5)
    for got, want in ((y, ref[0]), (invstd, ref[2]), (rv_new, ref[4])):
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    ok = torch.isfinite(ref[2])
    torch.testing.assert_close(invstd.double()[ok], ref[2][ok], rtol=1e-5, atol=0)


def test_given_sums_of_the_wrong_shape_are_refused():
    x, w, b, rm, rv = _inputs((2, 5, 4, 3), torch.float32, "channels_last")
    with pytest.raises(ValueError, match="sums must be"):
        kernels.batch_norm_train(x, w, b, rm, rv, [], "acc", 0.1, 1e-5, sums=_sums(x)[:, :4].contiguous())
    with pytest.raises(ValueError, match="sums must be"):
        kernels.batch_norm_stats(x, w, b, rm, rv, 0.1, 1e-5, sums=_sums(x).double())
