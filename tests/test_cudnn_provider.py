"""The cudnn provider's refusals on a machine without it (CI): every reason is specific, nothing crashes.

Its graphs themselves need a GPU and the nvidia-cudnn-frontend extra: bench/cudnn_check.py checks their
numerics against the unfused reference and times them there."""
import dataclasses
import gc

import pytest
import torch

from resfuse import epilogue as epi
from resfuse.ops.fused import Output
from resfuse.providers import candidates, cudnn, fold_bn
from resfuse.tuning.choose import Call


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


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _sums64(y):
    yd = y.double()
    return torch.stack([yd.sum((0, 2, 3)), (yd * yd).sum((0, 2, 3))])


def test_conv_stats_refusals_on_cpu():
    x, w, stride, padding, dilation = _conv_stats_inputs((1, 8, 5, 5), 4, 3, 1, torch.float16, "cpu")
    why = cudnn.conv_stats_refusal(x, w, (1, 4, 5, 5), (100, 1, 20, 4), stride, padding, dilation)
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
    why = cudnn.conv_stats_refusal(x, w, y_ref.shape, y_ref.stride(), stride, padding, dilation)
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


# ---- conv_dgrad + epilogue (training's conv2d_dgrad) ---------------------------------------------------------------
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


# ---- inference batch norm folded into the conv's weight ------------------------------------------------------------
BN_RELU = "relu(bn[#1e-05](acc,c0,c1,c2,c3))"


def _bn_vectors(k, device="cpu", dtype=torch.float32):
    return [torch.randn(k, device=device).to(dtype), (torch.rand(k, device=device) + 0.1).to(dtype),
            torch.randn(k, device=device).to(dtype), torch.randn(k, device=device).to(dtype)]


@pytest.mark.parametrize("sig", [BN_RELU, "relu(add(bn[#0.001](acc,c0,c1,c2,c3),full4))",
                                 "sigmoid(mul(bn[#1e-05](acc,c1,c2,c3,c4),c0))"])
def test_fold_bn_gives_the_same_epilogue_on_the_scaled_accumulator(sig):
    """The folded tree on conv(x, w * scale) + shift is the tree on conv(x, w): checked in float64 on the
    epilogue reference, the accumulator scaled per channel as the folded weight scales it."""
    torch.manual_seed(4)
    tree = epi.parse(sig)
    n_ops = len(epi.operands(tree))
    folded, bn = epi.fold_bn(tree, n_ops)
    assert bn.name == "bn" and "bn" not in str(folded) and f"add(acc,c{n_ops})" in str(folded)
    k, rows = 6, 10
    ops = [torch.randn(rows, k, dtype=torch.float64) for _ in range(n_ops)]
    mean, var, weight, bias = (torch.randn(k, dtype=torch.float64) for _ in range(4))
    var = var.abs() + 0.1
    for o, v in zip(bn.args[1:], (mean, var, weight, bias)):
        ops[o.slot] = v.expand(rows, k)
    scale = weight / torch.sqrt(var + bn.params[0])
    acc = torch.randn(rows, k, dtype=torch.float64)
    as3 = [t.reshape(1, rows, k) for t in ops]
    want = epi.reference(tree, acc.reshape(1, rows, k), as3)
    shift = (bias - mean * scale).expand(rows, k).reshape(1, rows, k)
    got = epi.reference(folded, (acc * scale).reshape(1, rows, k), [*as3, shift])
    torch.testing.assert_close(got, want)
    assert epi.fold_bn(epi.parse("relu(add(acc,c0))"), 1) is None


def test_fold_refusals_and_the_folded_call_on_cpu():
    x, w = torch.randn(2, 4, 5, 5).half(), torch.randn(6, 4, 3, 3).half()
    vecs = _bn_vectors(6)
    out = Output.of([2, 6, 5, 5], torch.float16, torch.device("cpu"))
    call = Call("conv2d", (x, w), vecs, BN_RELU, ([1, 1], [1, 1], [1, 1]), out)
    assert fold_bn.fold_refusal(call) is None
    assert "no batch norm" in fold_bn.fold_refusal(dataclasses.replace(call, signature="relu(add(acc,c0))"))
    assert "float32 weight" in fold_bn.fold_refusal(dataclasses.replace(call, inputs=(x, w.float())))
    wide = [v.expand(2, 6) for v in vecs]
    assert "one value per output channel" in fold_bn.fold_refusal(dataclasses.replace(call, operands=wide))
    folded = fold_bn.folded_call(call)
    assert folded.signature == "relu(add(acc,c4))" and folded.operands[:4] == vecs
    scale = vecs[2] / torch.sqrt(vecs[1] + 1e-5)
    torch.testing.assert_close(folded.inputs[1].float(), (w.float() * scale.view(-1, 1, 1, 1)).half().float())
    torch.testing.assert_close(folded.operands[4], vecs[3] - vecs[0] * scale)


def test_a_fold_follows_in_place_updates_and_dies_with_its_sources():
    """The folded weight and shift are kept while the sources' version counters hold, refolded in place (the
    same tensors, which a CUDA graph reads) when one moves, and dropped once a source is garbage."""
    w, vecs = torch.randn(5, 3, 1, 1).half(), _bn_vectors(5)
    call = Call("conv2d", (torch.randn(1, 3, 2, 2).half(), w), vecs, BN_RELU, ([1, 1], [0, 0], [1, 1]),
                Output.of([1, 5, 2, 2], torch.float16, torch.device("cpu")))
    first = fold_bn.folded_call(call)
    fw, shift = first.inputs[1], first.operands[4]
    before = fw.clone()
    assert fold_bn.folded_call(call).inputs[1] is fw  # cached
    with fold_bn.recording_folds() as used:
        fold_bn.folded_call(call)
    watch = fold_bn.FoldWatch(used * 2)
    assert len(watch.folds) == 1 and len(watch.sources) == 5
    with torch.no_grad():
        vecs[2].mul_(-3.0)  # the batch norm's weight, as an optimizer step or load_state_dict writes it
    watch.refresh()
    torch.testing.assert_close(fw.float(), (before.float() * -3.0), atol=2e-3, rtol=2e-3)
    scale = vecs[2] / torch.sqrt(vecs[1] + 1e-5)
    torch.testing.assert_close(shift, vecs[3] - vecs[0] * scale)
    assert fold_bn.folded_call(call).inputs[1] is fw
    assert any(f.w is fw for f in fold_bn._FOLDS.values())
    del call, first, vecs, watch
    gc.collect()
    other = Call("conv2d", (torch.randn(1, 3, 2, 2).half(), w), _bn_vectors(5), BN_RELU, ([1, 1], [0, 0], [1, 1]),
                 Output.of([1, 5, 2, 2], torch.float16, torch.device("cpu")))
    fold_bn.folded_call(other)  # a new entry drops the ones whose sources are gone
    assert not any(f.w is fw for f in fold_bn._FOLDS.values())


def test_a_fold_that_overflows_runs_unfolded_and_its_graph_is_captured_again(monkeypatch, capsys):
    """A refold whose weight overflows fp16 (the batch norm's weight grown 1e5-fold in place) is never read:
    folded_call gives None, the graph's FoldWatch says so before the replay, and CudaGraphed captures again
    with the conv unfolded, which then follows the parameters in place (fake CUDA graphs; the folded call's
    arithmetic on ATen stands in for cuDNN's on CPU)."""
    from resfuse.capture.cuda_graphs import CudaGraphed
    from resfuse.providers import aten
    from tests.test_cuda_graphs import _fake_cuda, _FakeGraph

    _fake_cuda(monkeypatch)
    torch.manual_seed(7)
    x, w, vecs = torch.randn(2, 3, 4, 4), torch.randn(5, 3, 1, 1).half(), _bn_vectors(5)
    params, out = ([1, 1], [0, 0], [1, 1]), Output.of([2, 5, 4, 4], torch.float32, torch.device("cpu"))
    folded_runs = []

    def fn(args):
        call = Call("conv2d", (args[0], args[1].float()), list(args[2:]), BN_RELU, params, out)
        folded = fold_bn.folded_call(dataclasses.replace(call, inputs=tuple(args[:2])))
        folded_runs.append(folded is not None)

        def run():  # what the graph runs: cuDNN's folded graph, reading the folded weight and shift in place
            if folded is None:
                return aten.run(call, out.empty())
            acc = torch.nn.functional.conv2d(args[0], folded.inputs[1].float())
            return torch.relu(acc + folded.operands[4].view(1, -1, 1, 1))

        got = run()
        if _FakeGraph.capturing is not None:
            _FakeGraph.capturing.work = lambda: got.copy_(run())
        return [got]

    class OnCuda(CudaGraphed):
        @staticmethod
        def _on_cuda(args):
            return True

    def want():
        return _reference64(x, w, vecs, BN_RELU, params, out)

    graphed = OnCuda(fn)
    for _ in range(3):  # eager, capture, replay
        got = graphed([x, w, *vecs])[0]
    assert _FakeGraph.made == 1 and folded_runs == [True] * 3 and rel(got, want()) < 4e-3
    with torch.no_grad():
        vecs[2].mul_(1e5)
    got = graphed([x, w, *vecs])[0]
    assert _FakeGraph.made == 2 and folded_runs[3:] == [False, False]  # captured again (warm-up, capture)
    assert "overflows" in capsys.readouterr().out
    assert torch.isfinite(got).all() and rel(got, want()) < 1e-5
    # The provider's own fallback, ATen: a scale of 1e5 overflows the fp16 folded weight, not this output.
    small, big = (x * 1e-4).half(), [torch.zeros(5), torch.ones(5), torch.full((5,), 1e5), torch.zeros(5)]
    half = Call("conv2d", (small, w), big, BN_RELU, params, dataclasses.replace(out, dtype=torch.float16))
    got = cudnn.run(half, half.out.empty().fill_(float("nan")), {"fold_bn": True})
    assert torch.isfinite(got).all() and rel(got, _reference64(small, w, big, BN_RELU, params, half.out)) < 4e-3
    with torch.no_grad():
        vecs[2].div_(1e5)
    got = graphed([x, w, *vecs])[0]  # the unfolded graph replays, reading the parameters in place
    assert _FakeGraph.made == 2 and len(folded_runs) == 5 and rel(got, want()) < 4e-3


def _bn_conv_case(shape, cout, k, stride, sig, dtype=torch.float16):
    cl, dev = torch.channels_last, "cuda"
    x = torch.randn(shape, device=dev).to(dtype).contiguous(memory_format=cl)
    w = (torch.randn(cout, shape[1], k, k, device=dev) / (shape[1] * k * k) ** 0.5).to(dtype)
    w = w.contiguous(memory_format=cl)
    params = ([stride] * 2, [k // 2] * 2, [1, 1])
    oh = (shape[2] + 2 * (k // 2) - k) // stride + 1
    ow = (shape[3] + 2 * (k // 2) - k) // stride + 1
    out_shape = [shape[0], cout, oh, ow]
    ops = _bn_vectors(cout, dev, dtype)
    if "full4" in sig:
        ops.append(torch.randn(out_shape, device=dev).to(dtype).contiguous(memory_format=cl))
    return x, w, ops, params, Output.of(out_shape, dtype, torch.device(dev), cl)


def _reference64(x, w, ops, sig, params, out):
    from resfuse.providers import aten

    up = Call("conv2d", (x.double(), w.double()), [t.double() for t in ops], sig, params,
              dataclasses.replace(out, dtype=torch.float64))
    return aten.run(up, up.out.empty())


@pytest.mark.skipif(not torch.cuda.is_available() or cudnn._cudnn() is None,
                    reason="needs a CUDA GPU and nvidia-cudnn-frontend (run on the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sig", [BN_RELU, "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))"])
@pytest.mark.parametrize("shape,cout,k,stride", [((4, 64, 14, 14), 96, 3, 1), ((3, 32, 15, 13), 64, 3, 2),
                                                 ((2, 16, 9, 9), 40, 1, 1)])
def test_folded_bn_graph_matches_the_reference(dtype, sig, shape, cout, k, stride):
    """conv with the batch norm folded into its weight, then shift (+ residual) + relu, against float64."""
    torch.manual_seed(5)
    if "full4" in sig and stride == 2:
        return  # a residual block's tail is stride 1
    x, w, ops, params, out = _bn_conv_case(shape, cout, k, stride, sig, dtype)
    call = Call("conv2d", (x, w), ops, sig, params, out)
    assert fold_bn.fold_refusal(call) is None
    want, tol = _reference64(x, w, ops, sig, params, out), 4e-3 if dtype == torch.float16 else 2e-2
    got = cudnn.run(call, out.empty().fill_(float("nan")), {"fold_bn": True})
    assert not got.isnan().any()
    assert rel(got, want) < tol
    found = cudnn.candidates(call, "fast")
    assert found and all(c.name.startswith("cudnn+fold_bn:") and c.config["fold_bn"] for c in found)
    for c in found:  # every engine config offered computes the same conv; each runs on its own scratch output
        c.run().fill_(float("nan"))
        got = c.run()
        assert not got.isnan().any() and rel(got, want) < tol, c.name
    plan = cudnn._plan(call, True)  # each candidate ran its own engine config: each one was built
    assert sorted(plan.workspace_bytes) == list(range(len(found))) and len(found) == min(3, len(plan.engines))


@pytest.mark.skipif(not torch.cuda.is_available() or cudnn._cudnn() is None,
                    reason="needs a CUDA GPU and nvidia-cudnn-frontend (run on the GPU machine)")
def test_folded_bn_follows_in_place_updates_under_cuda_graph_replay():
    """An inference graph replays the folded weight at its address without calling the op: CudaGraphed folds
    again before the replay when a batch-norm parameter changed in place (as load_state_dict writes it)."""
    from resfuse.capture.cuda_graphs import CudaGraphed

    torch.manual_seed(6)
    x, w, ops, params, out = _bn_conv_case((2, 32, 10, 10), 48, 3, 1, BN_RELU)

    def fn(args):
        call = Call("conv2d", tuple(args[:2]), list(args[2:]), BN_RELU, params, out)
        return [cudnn.run(call, out.empty(), {"fold_bn": True})]

    fn._boxed_call = True
    graphed = CudaGraphed(fn)
    for _ in range(3):  # eager, capture, replay
        got = graphed([x, w, *ops])[0]
    assert graphed.graph is not None
    assert rel(got, _reference64(x, w, ops, BN_RELU, params, out)) < 4e-3
    with torch.no_grad():
        ops[2].mul_(-2.0)
        ops[1].add_(1.0)
    got = graphed([x, w, *ops])[0]
    assert rel(got, _reference64(x, w, ops, BN_RELU, params, out)) < 4e-3


# ---- engine configs built by compile workers (tuning/precompile.py) --------------------------------------------------
def test_the_folded_form_is_the_folded_calls_layout():
    """What a worker builds the folded graph from, without the data: the folded call's signature, operands and
    weight, in shape, strides and dtype."""
    cl = torch.channels_last
    x, w = torch.randn(2, 4, 5, 5).half().contiguous(memory_format=cl), torch.randn(6, 4, 3, 3).half()
    call = Call("conv2d", (x, w.contiguous(memory_format=cl)), _bn_vectors(6), BN_RELU, ([1, 1], [1, 1], [1, 1]),
                Output.of([2, 6, 5, 5], torch.float16, torch.device("cpu"), cl))
    folded, form = fold_bn.folded_call(call), fold_bn.folded_form(call)

    def layout(c):
        return c.signature, [(tuple(t.shape), t.stride(), t.dtype) for t in (*c.inputs, *c.operands)]
    assert layout(form) == layout(folded) and form.signature != call.signature


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
    call = Call("conv2d", (x, w), _bn_vectors(6), BN_RELU, ([1, 1], [1, 1], [1, 1]),
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
    from resfuse.tuning import precompile

    x, w, ops, params, out = _bn_conv_case((4, 64, 14, 14), 96, 3, 1, BN_RELU)
    spec = cudnn.build_spec(Call("conv2d", (x, w), ops, BN_RELU, params, out), "fast")
    worker = precompile._Worker()
    try:
        assert worker.ask(dict(spec, index=0)) is True
        assert worker.ask(dict(spec, index=10 ** 6)) is False
    finally:
        worker.close()
