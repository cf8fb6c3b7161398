"""CudaGraphed's handouts (capture/cuda_graphs.py, _Handout) on fake CUDA graphs: a call's outputs come from graphs
that copy them into buffers of their own, handed out only while the caller holds nothing of them."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from .fake_graphs import FakeGraph, OnCudaGraphed, fake_cuda, product


def test_outputs_are_handed_out_only_while_the_caller_holds_none_of_them(monkeypatch):
    """A call returns a handout graph's buffers only where nothing the caller holds reads them: dropped outputs let
    one handout serve every call; `out = model(x)` holds one output while it makes the next, and two alternate; a
    caller that keeps every output, or only a view of one, or only its storage, gets outputs that later calls never
    overwrite (fake CUDA graphs; every input kept alive, so no address is reused)."""
    fake_cuda(monkeypatch)
    calls, w = [], torch.randn(4)
    xs = [torch.randn(3, 4) for _ in range(30)]
    wrapped = OnCudaGraphed(product(calls))
    for x in xs[:6]:  # the first call, the capture, then replays whose outputs are dropped at once
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert (FakeGraph.made, FakeGraph.shared, len(calls)) == (1, 1, 4)  # fn: first call, warm-up, 2 captures

    held, want = wrapped([xs[6], w])[0], xs[6] * w
    for x in xs[7:12]:  # `out = model(x)`: the last output is held during the call
        out = wrapped([x, w])[0]
        assert torch.equal(held, want) and torch.equal(out, x * w)
        held, want = out, x * w
    assert (FakeGraph.made, FakeGraph.shared, len(calls)) == (1, 2, 5)

    del held, out
    view = wrapped([xs[12], w])[0][1:]  # one handout read through a view only
    out = wrapped([xs[13], w])[0]  # the other through its storage only
    storage, want_storage = out.untyped_storage(), out.clone()
    del out
    kept = [wrapped([x, w])[0] for x in xs[14:20]]  # neither is free: outputs copied, every one kept
    for x in xs[20:26]:
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert all(torch.equal(k, x * w) for k, x in zip(kept, xs[14:20]))
    assert torch.equal(view, (xs[12] * w)[1:])
    assert torch.equal(torch.empty(0).set_(storage, 0, (3, 4)), want_storage)
    assert (FakeGraph.made, FakeGraph.shared, len(calls)) == (1, 2, 5)  # no more captures, no plain calls
    del kept, view, storage
    for x in xs[26:]:  # everything dropped: the handouts serve again
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert all(h.free() for h in wrapped.last.handouts)


def test_a_handout_that_does_not_reproduce_the_first_graph_is_dropped(monkeypatch):
    """A handout graph whose replay differs from the first graph's on the same inputs never serves a call: the
    signature's calls copy the first graph's outputs instead, said in the report's errors (fake CUDA graphs)."""
    fake_cuda(monkeypatch)
    captures = []

    def fn(args):
        x, w = args
        out = x * w
        if FakeGraph.capturing is not None:
            captures.append(1)
            extra = 1.0 if len(captures) == 2 else 0.0  # the second capture, the first handout, replays wrong
            FakeGraph.capturing.work = lambda: out.copy_(x * w + extra)
        return [out]

    class Report:
        errors = []

    wrapped, w = OnCudaGraphed(fn, Report), torch.randn(4)
    xs = [torch.randn(3, 4) for _ in range(6)]
    for x in xs:
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert len(Report.errors) == 1 and "copies its outputs out" in Report.errors[0]
    assert wrapped.last.handouts == [] and FakeGraph.shared == 1


def test_outputs_over_the_handout_size_are_copied_after_each_replay(monkeypatch):
    """A signature whose outputs pass HANDOUT_BYTES captures no handout graph: its calls replay the first graph and
    copy the outputs out, every one right; a smaller signature of the same function still hands out (fake CUDA
    graphs)."""
    from resfuse.capture.cuda_graphs import handout_refusal

    fake_cuda(monkeypatch)
    calls = []

    class Small(OnCudaGraphed):
        HANDOUT_BYTES = 3 * 4 * 4  # a [3, 4] fp32 output fits, a [5, 4] one does not

    wrapped, w = Small(product(calls)), torch.randn(4)
    kept = []
    for rows in (5, 5, 5, 5, 3, 3, 3, 3):
        x = torch.randn(rows, 4)
        kept.append(x)
        assert torch.equal(wrapped([x, w])[0], x * w)
    refused = {sig[0][0][0]: cap.handouts_refused for sig, cap in wrapped.captures.items()}
    assert refused[5] == "outputs of 80 bytes, over 48" and refused[3] is None
    assert (FakeGraph.made, FakeGraph.shared) == (2, 1)
    assert handout_refusal([torch.empty(2), None, 3], 8) is None


def test_a_handout_copies_every_tensor_output_and_keeps_the_others(monkeypatch):
    """Outputs of several tensors and a non-tensor: a handout copies each tensor into its own buffer and returns
    the non-tensor as it is; an output kept holds its handout whole (fake CUDA graphs)."""
    fake_cuda(monkeypatch)

    def fn(args):
        x, w = args
        prod, total = x * w, x + w
        if FakeGraph.capturing is not None:
            FakeGraph.capturing.work = lambda: (prod.copy_(x * w), total.copy_(x + w))
        return [prod, None, total]

    wrapped, w = OnCudaGraphed(fn), torch.randn(4)
    xs = [torch.randn(3, 4) for _ in range(8)]
    held = want = None
    for x in xs:
        out = wrapped([x, w])
        assert out[1] is None and torch.equal(out[0], x * w) and torch.equal(out[2], x + w)
        if held is not None:  # only the second tensor of the last call's outputs is held: its handout is not free
            assert torch.equal(held, want)
        held, want = out[2], x + w
        del out
    assert FakeGraph.shared == 2


@settings(max_examples=40, deadline=None)
@given(keeps=st.lists(st.sampled_from(["drop", "tensor", "view", "storage"]), min_size=3, max_size=14),
       data=st.data())
def test_whatever_a_caller_keeps_no_later_call_overwrites(keeps, data):
    """A random run of calls, each output dropped or kept (whole, as a view, or as its storage alone), and some kept
    ones let go along the way: every call returns its own right values, and every output still kept reads at the end
    what its call returned (fake CUDA graphs; outputs and inputs of distinct values a call)."""
    mp = pytest.MonkeyPatch()
    try:
        fake_cuda(mp)
        wrapped, w = OnCudaGraphed(product([])), torch.randn(4)
        xs = [torch.randn(3, 4) for _ in keeps]  # kept alive: no address is reused
        kept = {}
        for i, (x, keep) in enumerate(zip(xs, keeps)):
            out = wrapped([x, w])[0]
            assert torch.equal(out, x * w)
            if keep == "tensor":
                kept[i] = out
            elif keep == "view":
                kept[i] = out[1:]
            elif keep == "storage":
                kept[i] = out.untyped_storage()
            del out
            if kept and data.draw(st.booleans()):  # let go of the oldest output still kept
                kept.pop(next(iter(kept)))
        for i, held in kept.items():
            want = xs[i] * w
            if keeps[i] == "view":
                assert torch.equal(held, want[1:])
            elif keeps[i] == "storage":
                assert torch.equal(torch.empty(0).set_(held, 0, (3, 4)), want)
            else:
                assert torch.equal(held, want)
    finally:
        mp.undo()
