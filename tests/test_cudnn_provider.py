"""The cudnn provider's refusals on a machine without it (CI): every reason is specific, nothing crashes.

Its graphs themselves need a GPU and the nvidia-cudnn-frontend extra: bench/cudnn_check.py checks their
numerics against the unfused reference and times them there. The batch norm folded into the conv's weight has
its own file, test_fold_bn.py."""
import dataclasses

import pytest
import torch

from resfuse import epilogue as epi
from resfuse.ops.fused import Output
from resfuse.providers import candidates, cudnn, cudnn_stats, fold_bn
from resfuse.tuning.choose import Call

from .cudnn_cases import BN_RELU, bn_conv_case, bn_vectors, rel


def _conv_call(sig="relu(add(acc,c0))", device="cpu"):
    x, w = torch.randn(1, 4, 5, 5, device=device), torch.randn(6, 4, 3, 3, device=device)
    return Call("conv2d", (x, w), [torch.randn(6, device=device)], sig, ([1, 1], [1, 1], [1, 1]),
                Output.of([1, 6, 5, 5], torch.float32, torch.device(device)))


def _gemm_call(a, b, operands, sig, out_shape, dtype=torch.float16, device="cpu"):
    return Call("gemm", (a, b), operands, sig, (out_shape,), Output.of(out_shape, dtype, torch.device(device)))


def test_refusals_say_why():
    gemm = _gemm_call(torch.randn(3, 4), torch.randn(4, 5), [], "relu(acc)", [3, 5], torch.float32)
    assert "fp16/bf16 only" in cudnn.refusal(gemm)
    a, b = torch.randn(6, 4).half(), torch.randn(4, 5).half()
    assert "CUDA device" in cudnn.refusal(_gemm_call(a, b, [], "relu(acc)", [2, 3, 5]))
    assert "batched" in cudnn.refusal(_gemm_call(a.view(2, 3, 4), b, [], "relu(acc)", [2, 3, 5]))
    assert "empty product" in cudnn.refusal(_gemm_call(a[:0], b, [], "relu(acc)", [0, 5]))
    per_sample = torch.randn(2, 1, 5).half()  # an "nc" operand: no [1, M, N] broadcast form
    assert "operand 0 (nc" in cudnn.refusal(_gemm_call(a, b, [per_sample], "add(acc,nc0)", [2, 3, 5]))
    strided = torch.randn(3, 2, 5).half().transpose(0, 1)  # [2, 3, 5] whose rows do not merge into [1, M, N]
    assert "operand 0 (full" in cudnn.refusal(_gemm_call(a, b, [strided], "add(acc,full0)", [2, 3, 5]))
    conv_like = Call("gemm", (a, b), [], "relu(acc)", ([6, 5],), Output((6, 5), (1, 6), torch.float16,
                                                                         torch.device("cpu")))
    assert "contiguous rows" in cudnn.refusal(conv_like)
    assert "CUDA device" in cudnn.refusal(_conv_call())
    if cudnn._cudnn() is None:
        assert cudnn.refusal(_conv_call()) is not None
    assert "no cuDNN pointwise form" in cudnn._unsupported(epi.parse("hardswish(acc)"))
    assert cudnn._unsupported(epi.parse("relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))")) is None
    assert cudnn._unsupported(epi.parse("threshold_bwd[#0.0](add(acc,full0),full1)")) is None
    dy, w = torch.randn(2, 6, 5, 5), torch.randn(6, 2, 3, 3)  # groups 2: out has 4 channels, w 2 per group
    grouped = Call("conv2d_dgrad", (dy, w), [], "acc", ([1, 1], [1, 1], [1, 1]),
                   Output.of([2, 4, 5, 5], torch.float32, torch.device("cpu")))
    assert "grouped convolution" in cudnn.refusal(grouped)
    x, w = torch.randn(32, 480, 1, 1).half(), torch.randn(20, 480, 1, 1).half()  # a squeeze-excitation conv
    one_pixel = Call("conv2d", (x, w), [torch.randn(20).half()], "silu(add(acc,c0))", ([1, 1], [0, 0], [1, 1]),
                     Output.of([32, 20, 1, 1], torch.float16, torch.device("cpu")))
    assert cudnn.refusal(one_pixel) == cudnn.ONE_PIXEL
    one_pixel_stats = cudnn_stats.conv_stats_refusal(x, w, (32, 20, 1, 1), (20, 1, 1, 1), [1, 1], [0, 0], [1, 1])
    assert one_pixel_stats == cudnn.ONE_PIXEL


def test_no_cudnn_candidates_on_cpu():
    assert not any(c.provider == "cudnn" for c in candidates(_conv_call(), "fast"))


def test_each_engine_config_is_a_candidate_of_its_own(monkeypatch):
    """The level's first engine configs of cuDNN's ranked list, each a candidate named and configured by engine;
    the folded graph alone where the batch norm can fold, the written-out one where the fold is refused or
    cannot be planned; run() hands the chosen name to the plan."""
    made, ran = [], []

    class FakePlan:
        engines = [f"eng{i}" for i in range(6)]

        def run(self, call, out, engine):
            ran.append((call.signature, engine))
            return out

    def fake_plan(call, fold=False):
        made.append(fold)
        if fold and "unplannable" in made:
            raise RuntimeError("no engine")
        return FakePlan()

    monkeypatch.setattr(cudnn, "_plan", fake_plan)
    monkeypatch.setattr(cudnn, "folded_call", lambda call: dataclasses.replace(call, signature="folded"))
    call = _conv_call("relu(bn[#1e-05](acc,c0,c1,c2,c3))")
    monkeypatch.setattr(cudnn, "fold_refusal", lambda call: None)
    fast = cudnn.candidates(call, "fast")
    assert made == [True] and [c.name for c in fast] == [f"cudnn+fold_bn:eng{i}" for i in range(3)]
    assert [c.config for c in fast[:2]] == [{"fold_bn": True, "engine": "eng0"}, {"fold_bn": True, "engine": "eng1"}]
    fast[2].run()
    assert ran == [("folded", "eng2")]
    assert len(cudnn.candidates(call, "max")) == 6 and len(cudnn.candidates(call, "none")) == 1
    made[:] = ["unplannable"]
    assert [c.name for c in cudnn.candidates(call, "fast")][:1] == ["cudnn:eng0"] and made[1:] == [True, False]
    monkeypatch.setattr(cudnn, "fold_refusal", lambda call: "training")
    made[:] = []
    unfolded = cudnn.candidates(call, "fast")
    assert made == [False] and unfolded[2].config == {"engine": "eng2"}
    unfolded[2].run()
    assert ran[-1] == (call.signature, "eng2")


# ---- conv + genstats (training's conv2d_stats) ---------------------------------------------------------------------
def _conv_stats_inputs(shape, cout, k, stride, dtype, device, channels_last=True):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(shape, device=device).to(dtype).contiguous(memory_format=fmt)
    w = (torch.randn(cout, shape[1], k, k, device=device) / (shape[1] * k * k) ** 0.5).to(dtype)
    return x, w.contiguous(memory_format=fmt), [stride] * 2, [k // 2] * 2, [1, 1]


def _sums64(y):
    yd = y.double()
    return torch.stack([yd.sum((0, 2, 3)), (yd * yd).sum((0, 2, 3))])


def test_conv_stats_refusals_on_cpu():
    x, w, stride, padding, dilation = _conv_stats_inputs((1, 8, 5, 5), 4, 3, 1, torch.float16, "cpu")
    why = cudnn_stats.conv_stats_refusal(x, w, (1, 4, 5, 5), (100, 1, 20, 4), stride, padding, dilation)
    assert "CUDA device" in why or "not installed" in why


@pytest.mark.parametrize("channels_last", [True, False])
def test_conv2d_stats_reference_matches_the_conv_and_float64_sums(channels_last):
    from resfuse import ops

    torch.manual_seed(0)
    x, w, stride, padding, dilation = _conv_stats_inputs((2, 5, 7, 6), 3, 3, 2, torch.float32, "cpu", channels_last)
    y, sums = ops.conv2d_stats(x, w, stride, padding, dilation, channels_last, "reference")
    want = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding)
    torch.testing.assert_close(y, want)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt) and sums.dtype == torch.float32 and sums.shape == (2, 3)
    torch.testing.assert_close(sums.double(), _sums64(y), rtol=1e-5, atol=1e-5)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fy, fsums = ops.conv2d_stats(mode.from_tensor(x), mode.from_tensor(w), stride, padding, dilation,
                                     channels_last, "reference")
    assert fy.shape == y.shape and fy.stride() == y.stride() and fsums.shape == sums.shape


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available() or cudnn._cudnn() is None,
                    reason="needs a CUDA GPU and nvidia-cudnn-frontend (run on the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,cout,k,stride", [((4, 64, 14, 14), 96, 1, 1), ((3, 32, 15, 13), 64, 3, 2),
                                                 ((2, 16, 9, 9), 32, 3, 1), ((4, 8, 9, 7), 16, 1, 1)])
def test_conv2d_stats_on_cudnn_matches_the_reference(dtype, shape, cout, k, stride):
    from resfuse import ops

    torch.manual_seed(1)
    x, w, stride, padding, dilation = _conv_stats_inputs(shape, cout, k, stride, dtype, "cuda")
    y_ref = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding)
    why = cudnn_stats.conv_stats_refusal(x, w, y_ref.shape, y_ref.stride(), stride, padding, dilation)
    if dtype == torch.bfloat16 and why is not None:  # cuDNN 9 on the H100 machine has no bf16 genstats engine
        assert "no conv + genstats engine" in why, why
        return
    assert why is None, why
    y, sums = ops.conv2d_stats(x, w, stride, padding, dilation, True, "cudnn")
    assert y.stride() == y_ref.stride()
    assert rel(y.float(), y_ref.float()) < 1e-2
    # genstats sums the fp32 values before y's rounding to fp16/bf16: each term may be off by half an ulp of y's
    # dtype, the sum by at most the sum of those (plus fp32's own rounding)
    half_ulp = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    yd = y.double().abs()
    bound = torch.stack([yd.sum((0, 2, 3)), 2 * (yd * yd).sum((0, 2, 3))]) * (half_ulp + 1e-6) + 1e-6
    err = (sums.double() - _sums64(y)).abs()
    assert (err <= bound).all(), (err.max(1), bound.min(1), sums[:, :4], _sums64(y)[:, :4])
    # again on a side stream, into poisoned outputs: the plan sets its handle's stream only when it changes
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    y2, sums2 = torch.full_like(y, float("nan")), torch.full_like(sums, float("nan"))
    with torch.cuda.stream(side):
        cudnn_stats.conv_stats(x, w, stride, padding, dilation, y2, sums2)
    torch.cuda.current_stream().wait_stream(side)
    assert rel(y2.float(), y.float()) < 1e-3  # a NaN left anywhere fails this
    assert ((sums2.double() - _sums64(y2)).abs() <= bound).all()


# ---- conv_dgrad + epilogue (training's conv2d_dgrad) ---------------------------------------------------------------
@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available() or cudnn._cudnn() is None,
                    reason="needs a CUDA GPU and nvidia-cudnn-frontend (run on the GPU machine)")
@pytest.mark.parametrize("sig", ["acc", "threshold_bwd[#0.0](acc,full0)", "threshold_bwd[#0.0](add(acc,full1),full0)"])
@pytest.mark.parametrize("shape,cin,k,stride", [((4, 64, 14, 14), 96, 3, 1), ((3, 32, 8, 7), 48, 3, 2),
                                                ((2, 16, 9, 9), 24, 1, 1)])
def test_conv2d_dgrad_graph_matches_the_reference(sig, shape, cin, k, stride):
    """conv_dgrad, then add and relu's gradient as pointwise nodes, against the unfused float64 computation;
    the output poisoned first, every element written."""
    from resfuse.providers import aten

    torch.manual_seed(2)
    n, cout, oh, ow = shape
    dev, cl = "cuda", torch.channels_last
    dy = torch.randn(shape, device=dev).half().contiguous(memory_format=cl)
    w = (torch.randn(cout, cin, k, k, device=dev) / (cout * k * k) ** 0.5).half().contiguous(memory_format=cl)
    h, wd = (oh - 1) * stride + 1 + (1 if stride == 2 else 0), (ow - 1) * stride + 1
    y = torch.randn(n, cin, h, wd, device=dev).half().contiguous(memory_format=cl)  # the relu output's stand-in
    res = torch.randn_like(y)
    y[0, 0, 0, 0] = 0.0  # relu's gradient at exactly the threshold: 0
    operands = [y, res][:1 + sig.count("full1")] if "full" in sig else []
    call = Call("conv2d_dgrad", (dy, w), operands, sig, ([stride] * 2, [k // 2] * 2, [1, 1]),
                Output.of([n, cin, h, wd], torch.float16, torch.device(dev), cl))
    assert cudnn.refusal(call) is None, cudnn.refusal(call)
    out = call.out.empty().fill_(float("nan"))
    got = cudnn.run(call, out)
    up = Call("conv2d_dgrad", (dy.double(), w.double()), [t.double() for t in operands], sig, call.params,
              Output.of([n, cin, h, wd], torch.float64, torch.device(dev), cl))
    want = aten.run(up, up.out.empty())
    assert got is out and got.stride() == want.stride() and not got.isnan().any()
    assert rel(got, want) < 2e-3
    if "threshold" in sig:
        assert got[0, 0, 0, 0] == 0


# ---- matmul + epilogue (a linear layer's GEMM) ---------------------------------------------------------------------
@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available() or cudnn._cudnn() is None,
                    reason="needs a CUDA GPU and nvidia-cudnn-frontend (run on the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sig", ["add(acc,c0)", "gelu(add(acc,c0))", "add(add(acc,c0),full1)", "relu(acc)"])
@pytest.mark.parametrize("m,n,k,out_shape", [(384, 768, 256, [2, 192, 768]), (197, 200, 72, [197, 200])])
def test_gemm_graph_matches_the_reference(dtype, sig, m, n, k, out_shape):
    """matmul on a linear layer's transposed weight, then bias, GELU (erf) or a residual as pointwise nodes,
    into a [B, S, N] view too, against the float64 computation; the output poisoned first."""
    from resfuse.providers import aten

    torch.manual_seed(3)
    dev = "cuda"
    a = torch.randn(m, k, device=dev).to(dtype)
    w = (torch.randn(n, k, device=dev) / k ** 0.5).to(dtype)  # nn.Linear's [N, K]: B is its transpose
    operands = [torch.randn(n, device=dev).to(dtype), torch.randn(out_shape, device=dev).to(dtype)]
    operands = operands[:sig.count("c0") + sig.count("full1")]
    call = _gemm_call(a, w.t(), operands, sig, out_shape, dtype, dev)
    assert cudnn.refusal(call) is None, cudnn.refusal(call)
    out = call.out.empty().fill_(float("nan"))
    got = cudnn.run(call, out)
    up = _gemm_call(a.double(), w.t().double(), [t.double() for t in operands], sig, out_shape, torch.float64, dev)
    want = aten.run(up, up.out.empty())
    assert got is out and not got.isnan().any()
    assert rel(got, want) < (4e-3 if dtype == torch.float16 else 2e-2)
    # again on a side stream, into a poisoned output: the plan moves its handle to the current stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    again = torch.full_like(out, float("nan"))
    with torch.cuda.stream(side):
        cudnn.run(call, again)
    torch.cuda.current_stream().wait_stream(side)
    assert rel(again.float(), got.float()) < 1e-3  # a NaN left anywhere fails this


# ---- engine configs built by compile workers (tuning/precompile.py) --------------------------------------------------
def test_a_workers_build_spec_rebuilds_the_graph_candidates_would_make(monkeypatch):
    """build_spec -> (pickled, as the worker receives it) -> build_engine: the plan is made from meta tensors laid
    out as the call's, folded where the fold is offered and written out where cuDNN does not support it folded, and
    the spec's engine config is built; none past the ranked list's end."""
    import pickle

    made, built = [], []

    class FakePlan:
        def __init__(self, call):
            made.append(call)
            if "unsupported" in built and call.signature != BN_RELU:
                raise RuntimeError("no engine for the folded graph")
            self.engines = ["eng0", "eng1"]
            self.graph = type("G", (), {"build_plan_at_index": lambda _, i: built.append(i)})()

    monkeypatch.setattr(cudnn, "refusal", lambda call: None)
    monkeypatch.setattr(cudnn, "Plan", FakePlan)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    x, w = torch.randn(2, 4, 5, 5).half(), torch.randn(6, 4, 3, 3).half()
    call = Call("conv2d", (x, w), bn_vectors(6), BN_RELU, ([1, 1], [1, 1], [1, 1]),
                Output.of([2, 6, 5, 5], torch.float16, torch.device("cpu")))
    spec = pickle.loads(pickle.dumps(cudnn.build_spec(call, "fast")))
    assert spec["engines"] == cudnn.ENGINES["fast"] and spec["fold"] and spec["kind"] == "cudnn"
    assert cudnn.build_spec(call, "max") is None  # their number is the graph's
    assert cudnn.build_engine(dict(spec, index=1)) and built == [1]
    (plan_call,) = made
    assert plan_call.signature == fold_bn.folded_form(call).signature
    assert all(t.device.type == "meta" for t in (*plan_call.inputs, *plan_call.operands))
    assert [(t.shape, t.stride(), t.dtype) for t in plan_call.inputs] == [(t.shape, t.stride(), t.dtype)
                                                                          for t in call.inputs]
    assert not cudnn.build_engine(dict(spec, index=2)) and built == [1]  # the list has 2
    built[:], made[:] = ["unsupported"], []
    assert cudnn.build_engine(dict(spec, index=0)) and [c.signature for c in made] == [
        fold_bn.folded_form(call).signature, BN_RELU]
    made[:] = []
    assert cudnn.build_engine(dict(spec, fold=False, index=0)) and [c.signature for c in made] == [BN_RELU]


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available() or cudnn._cudnn() is None,
                    reason="needs a CUDA GPU and nvidia-cudnn-frontend (run on the GPU machine)")
def test_a_compile_worker_builds_an_engine_config():
    """A real worker process builds the first engine config of a folded conv + batch norm + relu graph."""
    from resfuse.tuning import workers

    x, w, ops, params, out = bn_conv_case((4, 64, 14, 14), 96, 3, 1, BN_RELU)
    spec = cudnn.build_spec(Call("conv2d", (x, w), ops, BN_RELU, params, out), "fast")
    worker = workers.Worker()
    try:
        assert worker.ask(dict(spec, index=0)) is True
        assert worker.ask(dict(spec, index=10 ** 6)) is False
    finally:
        worker.close()
