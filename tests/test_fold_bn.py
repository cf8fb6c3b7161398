"""The inference batch norm folded into a conv's weight (providers/fold_bn.py) for the cudnn provider: the folded
epilogue's arithmetic, the refusals, a fold that follows in-place updates and one that overflows (on CPU), the
folded call's layout without its data (what a compile worker builds from), and on the GPU the folded cuDNN graph
against float64, also under CUDA-graph replay."""
import dataclasses
import gc

import pytest
import torch

from resfuse import epilogue as epi
from resfuse.ops.fused import Output
from resfuse.providers import cudnn, fold_bn
from resfuse.tuning.choose import Call

from .cudnn_cases import BN_RELU, bn_conv_case, bn_vectors, rel


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
    vecs = bn_vectors(6)
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
    w, vecs = torch.randn(5, 3, 1, 1).half(), bn_vectors(5)
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
    other = Call("conv2d", (torch.randn(1, 3, 2, 2).half(), w), bn_vectors(5), BN_RELU, ([1, 1], [0, 0], [1, 1]),
                 Output.of([1, 5, 2, 2], torch.float16, torch.device("cpu")))
    fold_bn.folded_call(other)  # a new entry drops the ones whose sources are gone
    assert not any(f.w is fw for f in fold_bn._FOLDS.values())


def test_a_fold_follows_a_storage_swapped_under_its_tensors():
    """`p.data = t` (as older Module.to/half did) gives a source a new storage without a version bump: the fold is
    made again from the new values, and a weight of another shape gets a fold of its own."""
    torch.manual_seed(5)
    w, vecs = torch.randn(5, 3, 1, 1).half(), bn_vectors(5)

    def call():
        return Call("conv2d", (torch.randn(1, 3, 2, 2).half(), w), vecs, BN_RELU, ([1, 1], [0, 0], [1, 1]),
                    Output.of([1, 5, 2, 2], torch.float16, torch.device("cpu")))

    def expected():
        scale = vecs[2] / torch.sqrt(vecs[1] + 1e-5)
        return (w.float() * scale.view(-1, 1, 1, 1)).half().float(), vecs[3] - vecs[0] * scale

    fold_bn.folded_call(call())
    for swap in (lambda: setattr(w, "data", torch.randn(5, 3, 1, 1).half()),
                 lambda: setattr(vecs[0], "data", torch.randn(5)),
                 lambda: setattr(w, "data", torch.randn(5, 3, 3, 3).half())):
        swap()
        folded = fold_bn.folded_call(call())
        want_w, want_shift = expected()
        assert folded.inputs[1].shape == w.shape
        torch.testing.assert_close(folded.inputs[1].float(), want_w)
        torch.testing.assert_close(folded.operands[4], want_shift)


def test_a_fold_of_inference_tensors_is_folded_again_on_every_call():
    """Tensors made under torch.inference_mode have no version counter (reading it raises): a fold of them, and a
    graph's watch over it, fold again each time, so an in-place edit there is followed too."""
    with torch.inference_mode():
        w, vecs = torch.randn(5, 3, 1, 1).half(), bn_vectors(5)
        call = Call("conv2d", (torch.randn(1, 3, 2, 2).half(), w), vecs, BN_RELU, ([1, 1], [0, 0], [1, 1]),
                    Output.of([1, 5, 2, 2], torch.float16, torch.device("cpu")))
        with fold_bn.recording_folds() as used:
            fw = fold_bn.folded_call(call).inputs[1]
        watch = fold_bn.FoldWatch(used)
        before = fw.clone()
        vecs[2].mul_(-3.0)
        assert watch.refresh()
        torch.testing.assert_close(fw.float(), before.float() * -3.0, atol=2e-3, rtol=2e-3)
        vecs[2].mul_(2.0)
        assert fold_bn.folded_call(call).inputs[1] is fw
        torch.testing.assert_close(fw.float(), before.float() * -6.0, atol=4e-3, rtol=2e-3)


def test_a_fold_that_overflows_runs_unfolded_and_its_graph_is_captured_again(monkeypatch, capsys):
    """A refold whose weight overflows fp16 (the batch norm's weight grown 1e5-fold in place) is never read:
    folded_call gives None, the graph's FoldWatch says so before the replay, and CudaGraphed captures again
    with the conv unfolded, which then follows the parameters in place (fake CUDA graphs; the folded call's
    arithmetic on ATen stands in for cuDNN's on CPU)."""
    from resfuse.providers import aten
    from tests.fake_graphs import FakeGraph, OnCudaGraphed, fake_cuda

    fake_cuda(monkeypatch)
    torch.manual_seed(7)
    x, w, vecs = torch.randn(2, 3, 4, 4), torch.randn(5, 3, 1, 1).half(), bn_vectors(5)
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
        if FakeGraph.capturing is not None:
            FakeGraph.capturing.work = lambda: got.copy_(run())
        return [got]

    def want():
        return _reference64(x, w, vecs, BN_RELU, params, out)

    graphed = OnCudaGraphed(fn)
    for _ in range(3):  # eager; warm-up, capture and a handout's; the next handout's (the last output is held)
        got = graphed([x, w, *vecs])[0]
    assert FakeGraph.made == 1 and folded_runs == [True] * 5 and rel(got, want()) < 4e-3
    with torch.no_grad():
        vecs[2].mul_(1e5)
    got = graphed([x, w, *vecs])[0]
    assert FakeGraph.made == 2 and folded_runs[5:] == [False] * 3  # captured again (warm-up, capture, a handout)
    assert "overflows" in capsys.readouterr().out
    assert torch.isfinite(got).all() and rel(got, want()) < 1e-5
    # The provider's own fallback, ATen: a scale of 1e5 overflows the fp16 folded weight, not this output.
    small, big = (x * 1e-4).half(), [torch.zeros(5), torch.ones(5), torch.full((5,), 1e5), torch.zeros(5)]
    half = Call("conv2d", (small, w), big, BN_RELU, params, dataclasses.replace(out, dtype=torch.float16))
    got = cudnn.run(half, half.out.empty().fill_(float("nan")), {"fold_bn": True})
    assert torch.isfinite(got).all() and rel(got, _reference64(small, w, big, BN_RELU, params, half.out)) < 4e-3
    with torch.no_grad():
        vecs[2].div_(1e5)
    got = graphed([x, w, *vecs])[0]  # the unfolded graph's handout (free: got was reassigned) replays, reading the
    assert FakeGraph.made == 2 and len(folded_runs) == 8 and rel(got, want()) < 4e-3  # parameters in place


def _reference64(x, w, ops, sig, params, out):
    from resfuse.providers import aten

    up = Call("conv2d", (x.double(), w.double()), [t.double() for t in ops], sig, params,
              dataclasses.replace(out, dtype=torch.float64))
    return aten.run(up, up.out.empty())


@pytest.mark.requires_cuda
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
    x, w, ops, params, out = bn_conv_case(shape, cout, k, stride, sig, dtype)
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
    built = sorted({index for index, _ in plan.built.values()})  # {engine name: (its index, workspace bytes)}
    assert built == list(range(len(found))) and len(found) == min(3, len(plan.engines))


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available() or cudnn._cudnn() is None,
                    reason="needs a CUDA GPU and nvidia-cudnn-frontend (run on the GPU machine)")
def test_folded_bn_follows_in_place_updates_under_cuda_graph_replay():
    """An inference graph replays the folded weight at its address without calling the op: CudaGraphed folds
    again before the replay when a batch-norm parameter changed in place (as load_state_dict writes it)."""
    from resfuse.capture.cuda_graphs import CudaGraphed

    torch.manual_seed(6)
    x, w, ops, params, out = bn_conv_case((2, 32, 10, 10), 48, 3, 1, BN_RELU)

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


def test_the_folded_form_is_the_folded_calls_layout():
    """What a worker builds the folded graph from, without the data: the folded call's signature, operands and
    weight, in shape, strides and dtype."""
    cl = torch.channels_last
    x, w = torch.randn(2, 4, 5, 5).half().contiguous(memory_format=cl), torch.randn(6, 4, 3, 3).half()
    call = Call("conv2d", (x, w.contiguous(memory_format=cl)), bn_vectors(6), BN_RELU, ([1, 1], [1, 1], [1, 1]),
                Output.of([2, 6, 5, 5], torch.float16, torch.device("cpu"), cl))
    folded, form = fold_bn.folded_call(call), fold_bn.folded_form(call)

    def layout(c):
        return c.signature, [(tuple(t.shape), t.stride(), t.dtype) for t in (*c.inputs, *c.operands)]
    assert layout(form) == layout(folded) and form.signature != call.signature
