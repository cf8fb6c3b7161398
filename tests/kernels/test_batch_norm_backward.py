"""Training batch-norm backward under the interpreter against aten.native_batch_norm_backward in float64: the
three gradients, layouts (grad_out and x in different ones), ragged shapes, output masks, no weight, NaN/Inf,
determinism, a mean far from 0, and the statistics the forward kernel saved."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resfuse import kernels
from resfuse.kernels.batch_norm import BnConfig

from .epilogues import assert_close, with_layout

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATEN = torch.ops.aten.native_batch_norm_backward.default
CONFIGS = [None, BnConfig(4, 2, 3, 2), BnConfig(16, 4, 2, 1), BnConfig(2, 8, 5, 4), BnConfig(8, 16, 4, 4)]
SHAPES = st.one_of(
    st.tuples(st.integers(1, 9), st.sampled_from([1, 3, 5, 17])),  # [N, C]
    st.tuples(st.integers(1, 3), st.sampled_from([1, 3, 5, 17]), st.sampled_from([1, 7])),  # [N, C, L]
    st.tuples(st.integers(1, 3), st.sampled_from([1, 3, 5, 17]), st.sampled_from([1, 3, 9]), st.sampled_from([1, 3, 9])),
)
LAYOUTS = ["contiguous", "channels_last", "strided"]


def _inputs(shape, dtype, layout_x, layout_g, weight=True, param_dtype=torch.float32, mean=0.0):
    c = shape[1]
    x = with_layout((torch.randn(shape) * 2 + mean).to(dtype), layout_x)
    g = with_layout(torch.randn(shape).to(dtype), layout_g)
    dims = [0, *range(2, len(shape))]
    x64 = x.double()
    save_mean = x64.mean(dims).float()
    save_invstd = (x64.var(dims, unbiased=False) + 1e-5).rsqrt().float()
    w = (torch.rand(c) + 0.5).to(param_dtype) if weight else None
    return g, x, w, save_mean, save_invstd


def _aten64(g, x, w, save_mean, save_invstd, mask):
    dbl = [None if t is None else t.double() for t in (g, x, w, save_mean, save_invstd)]
    return ATEN(dbl[0], dbl[1], dbl[2], None, None, dbl[3], dbl[4], True, 1e-5, list(mask))


def _run(g, x, w, save_mean, save_invstd, mask, config=None):
    dx = torch.full_like(x, float("nan")) if mask[0] else None  # poisoned: every element must be written
    res = kernels.batch_norm_backward(g, x, w, save_mean, save_invstd, mask, dx, config)
    if mask[0]:
        assert res[0] is dx
    return res


def _check(res, g, x, w, save_mean, save_invstd, mask):
    want = _aten64(g, x, w, save_mean, save_invstd, mask)
    grad_dtype = w.dtype if w is not None else x.dtype
    for got, ref, on, dtype in zip(res, want, mask, (x.dtype, grad_dtype, grad_dtype)):
        if not on:
            assert got is None
            continue
        assert got.dtype == dtype and got.shape == ref.shape
        # the parameter gradients are sums over N*H*W products: held to the tolerance of their own dtype,
        # scaled by how many terms they add up
        assert_close(got, ref, dtype)


@settings(max_examples=60, deadline=None)
@given(shape=SHAPES, dtype=st.sampled_from(DTYPES), layout_x=st.sampled_from(LAYOUTS),
       layout_g=st.sampled_from(LAYOUTS), weight=st.booleans(), same_param_dtype=st.booleans(),
       mask=st.tuples(st.booleans(), st.booleans(), st.booleans()), config=st.sampled_from(CONFIGS))
def test_matches_aten(shape, dtype, layout_x, layout_g, weight, same_param_dtype, mask, config):
    g, x, w, save_mean, save_invstd = _inputs(shape, dtype, layout_x, layout_g, weight,
                                              dtype if same_param_dtype else torch.float32)
    before = [t.clone() for t in (g, x)]
    res = _run(g, x, w, save_mean, save_invstd, mask, config)
    assert torch.equal(before[0], g) and torch.equal(before[1], x), "an input was written"
    _check(res, g, x, w, save_mean, save_invstd, mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_resnet_shape_channels_last(dtype):
    """A ResNet stage's shape at a tiny batch: C not a multiple of the channel block, rows not of the row tile."""
    torch.manual_seed(0)
    g, x, w, m, istd = _inputs((3, 67, 7, 7), dtype, "channels_last", "channels_last")
    mask = (True, True, True)
    _check(_run(g, x, w, m, istd, mask), g, x, w, m, istd, mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_far_from_zero(dtype):
    torch.manual_seed(1)
    g, x, w, m, istd = _inputs((4, 5, 9, 9), dtype, "channels_last", "contiguous", mean=1000.0)
    mask = (True, True, True)
    _check(_run(g, x, w, m, istd, mask, BnConfig(16, 4, 3, 2)), g, x, w, m, istd, mask)


def test_statistics_of_the_forward_kernel():
    """The backward reads what the forward kernel saved: a forward + backward pair matches autograd in float64."""
    torch.manual_seed(2)
    x = torch.randn(2, 6, 5, 5).contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(6) + 0.5, torch.randn(6)
    _, save_mean, save_invstd, _, _ = kernels.batch_norm_train(x, w, b, None, None, [], "acc", 0.1, 1e-5)
    g = torch.randn_like(x)
    dx, dw, db = _run(g, x, w, save_mean, save_invstd, (True, True, True))
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    torch.nn.functional.batch_norm(x64, None, None, w64, b64, True, 0.1, 1e-5).backward(g.double())
    for got, want in ((dx, x64.grad), (dw, w64.grad), (db, b64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", [None, BnConfig(4, 2, 3, 2)])
def test_nan_and_inf_propagate_like_eager(config):
    torch.manual_seed(3)
    g, x, w, m, istd = _inputs((2, 5, 4, 3), torch.float32, "channels_last", "channels_last")
    g[1, 0, 2, 1] = float("nan")
    g[0, 1, 3, 2] = float("inf")
    mask = (True, True, True)
    got = _run(g, x, w, m, istd, mask, config)
    want = _aten64(g, x, w, m, istd, mask)
    for a, b in zip(got, want):
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isinf(a), torch.isinf(b)), (a, b)
        finite = torch.isfinite(b)
        torch.testing.assert_close(a.double()[finite], b[finite], rtol=1e-4, atol=1e-4)
    assert not torch.isfinite(got[0][:, [0, 1]]).any() and not torch.isfinite(got[1][[0, 1]]).any()


@pytest.mark.parametrize("config", [None, BnConfig(4, 2, 3, 2), BnConfig(8, 4, 7, 4)])
def test_bit_identical_across_runs(config):
    torch.manual_seed(4)
    args = _inputs((3, 6, 5, 5), torch.float16, "channels_last", "channels_last", mean=3.0)
    mask = (True, True, True)
    first = _run(*args, mask, config)
    _run(*_inputs((2, 9), torch.float32, "contiguous", "contiguous"), mask, config)
    second = _run(*args, mask, config)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@settings(max_examples=40, deadline=None)
@given(shape=SHAPES, dtype=st.sampled_from(DTYPES), layout_x=st.sampled_from(LAYOUTS),
       layout_g=st.sampled_from(LAYOUTS), layout_x2=st.sampled_from(LAYOUTS), weights=st.tuples(st.booleans(),
       st.booleans()), mask=st.tuples(st.booleans(), st.booleans(), st.booleans()), config=st.sampled_from(CONFIGS))
def test_two_batch_norms_of_one_grad_out(shape, dtype, layout_x, layout_g, layout_x2, weights, mask, config):
    """A downsampling block's main and shortcut batch norms share grad_out: one set of passes gives both their
    gradients, each equal to its own backward in float64. x2 at other strides than x runs the two one by one."""
    g, x, w, m, istd = _inputs(shape, dtype, layout_x, layout_g, weights[0])
    _, x2, w2, m2, istd2 = _inputs(shape, dtype, layout_x2, layout_g, weights[1], torch.float16, mean=-3.0)
    dx, dx2 = (torch.full_like(t, float("nan")) if mask[0] else None for t in (x, x2))
    before = [t.clone() for t in (g, x, x2)]
    res = kernels.batch_norm_backward(g, x, w, m, istd, mask, dx, config, second=(x2, w2, m2, istd2, dx2))
    assert all(torch.equal(a, b) for a, b in zip(before, (g, x, x2))), "an input was written"
    assert len(res) == 6 and (not mask[0] or (res[0] is dx and res[3] is dx2))
    _check(res[:3], g, x, w, m, istd, mask)
    _check(res[3:], g, x2, w2, m2, istd2, mask)


def test_two_batch_norms_give_what_each_gives_alone():
    """The shared pass adds each batch norm's sums in the order its own backward does: bit-identical results."""
    torch.manual_seed(5)
    g, x, w, m, istd = _inputs((3, 67, 5, 7), torch.float16, "channels_last", "channels_last")
    _, x2, w2, m2, istd2 = _inputs((3, 67, 5, 7), torch.float16, "channels_last", "channels_last", mean=2.0)
    mask = (True, True, True)
    both = kernels.batch_norm_backward(g, x, w, m, istd, mask, second=(x2, w2, m2, istd2, None))
    alone = (*_run(g, x, w, m, istd, mask), *_run(g, x2, w2, m2, istd2, mask))
    for a, b in zip(both, alone):
        assert torch.equal(a, b)


def test_bad_arguments_are_refused():
    g, x, w, m, istd = _inputs((2, 3, 4, 4), torch.float32, "contiguous", "contiguous")
    with pytest.raises(TypeError):
        kernels.batch_norm_backward(g.long(), x, w, m, istd, (True, True, True))
    with pytest.raises(ValueError):
        kernels.batch_norm_backward(g[:1], x, w, m, istd, (True, True, True))
    with pytest.raises(ValueError):
        kernels.batch_norm_backward(g, x, w[:2], m, istd, (True, True, True))
    with pytest.raises(TypeError):
        kernels.batch_norm_backward(g, x, w, m.half(), istd, (True, True, True))
