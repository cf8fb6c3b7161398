"""cuda_graphs=True: replays match eager for fresh inputs, parameters are read in place (GPU only); compiled
graphs take the boxed calling convention, so a backward graph frees the saved activations it is handed."""
import weakref

import pytest
import torch
from hypothesis import given, settings, strategies as st

import resfuse
from resfuse.capture.cuda_graphs import CudaGraphed

from .test_api import Block, rel


def test_cpu_inputs_run_the_function_as_it_is():
    seen = []
    wrapped = CudaGraphed(lambda a: seen.append(a) or [a[0] * 2])
    x = torch.randn(3)
    assert torch.equal(wrapped([x])[0], x * 2) and len(seen) == 1 and wrapped.graph is None


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: the function under capture registers how to recompute its
    output in place from the static inputs, and the copies made under capture (a handout's) are recorded, which
    is what replaying a real graph does. `made` counts captures of a graph of its own memory pool, `shared` those
    sharing another's (handouts)."""
    capturing = None
    made = shared = 0

    def __init__(self):
        self.work, self.copies = None, []

    def replay(self):
        self.work()
        for dst, src in self.copies:
            dst.copy_(src)

    def pool(self):
        return id(self)


class _RecordCopies(torch.overrides.TorchFunctionMode):
    """Records the copies made under a fake capture once the function captured has registered its work (it does
    so last): a handout's copies of the function's outputs, not copies inside the function (its work redoes those)."""
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and _FakeGraph.capturing is not None and _FakeGraph.capturing.work is not None:
            _FakeGraph.capturing.copies.append(args[:2])
        return func(*args, **(kwargs or {}))


def _fake_cuda(monkeypatch):
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g, pool=None):
        if pool is None:
            _FakeGraph.made += 1
        else:
            _FakeGraph.shared += 1
        _FakeGraph.capturing = g
        with _RecordCopies():
            yield
        _FakeGraph.capturing = None

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    _FakeGraph.made = _FakeGraph.shared = 0


def _product(calls: list, replay_adds=lambda batch: 0.0):
    """fn([x, w]) = [x * w], recording each call's batch; under a fake capture its graph recomputes x * w plus
    replay_adds(batch) in place (not zero: a graph that replays wrong)."""
    def fn(args):
        x, w = args
        calls.append(x.shape[0])
        out = x * w
        if _FakeGraph.capturing is not None:
            extra = replay_adds(x.shape[0])
            _FakeGraph.capturing.work = lambda: out.copy_(x * w + extra)
        return [out]
    return fn


def test_each_input_signature_keeps_its_graph(monkeypatch):
    """A dynamic batch alternating between sizes replays each size's graph without capturing again; past
    MAX_SIGNATURES the least recently used graph goes; a moved parameter re-captures (fake CUDA graphs)."""
    _fake_cuda(monkeypatch)
    calls = []
    fn = _product(calls)

    class OnCuda(CudaGraphed):
        MAX_SIGNATURES = 2

        @staticmethod
        def _on_cuda(args):
            return True

    wrapped, w = OnCuda(fn), torch.randn(4)
    # every input kept alive: a freed one's address may come back for the next (the allocator's choice), and
    # an input seen twice at one address counts as static (read in place) until it moves, then captures again
    kept = []
    for step in range(6):  # batch sizes 2, 3, 2, 3, ...: two first calls, two captures, then replays only
        x = torch.randn(2 + step % 2, 4)
        kept.append(x)
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert _FakeGraph.made == 2 and len(wrapped.captures) == 2
    ran = len(calls)
    for step in range(4):
        x = torch.randn(2 + step % 2, 4)
        kept.append(x)
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert len(calls) == ran and _FakeGraph.made == 2  # replays: the function itself never ran again
    x5 = torch.randn(5, 4)
    wrapped([x5, w])  # a third size: the least recently used (batch 2) goes
    assert {sig[0][0][0] for sig in wrapped.captures} == {3, 5}
    w2 = torch.randn(4)  # a parameter that moved: batch 3 captures again, and reads the new one
    x3 = torch.randn(3, 4)
    wrapped([x3, w2])
    assert torch.equal(wrapped([x3, w2])[0], x3 * w2) and _FakeGraph.made == 3


def test_a_replay_checks_addresses_and_scalars_not_only_objects(monkeypatch):
    """The fast path compares input objects, then addresses: a parameter whose storage was swapped under the
    same object (`p.data = ...`) captures again and reads the new values; a scalar input (a dynamic size)
    that changed is not replayed with the old one's graph (fake CUDA graphs)."""
    _fake_cuda(monkeypatch)

    def fn(args):
        x, w, k = args
        out = x * w * k
        if _FakeGraph.capturing is not None:
            _FakeGraph.capturing.work = lambda: out.copy_(x * w * k)
        return [out]

    class OnCuda(CudaGraphed):
        @staticmethod
        def _on_cuda(args):
            return True

    wrapped, w = OnCuda(fn), torch.nn.Parameter(torch.randn(4), requires_grad=False)
    xs = [torch.randn(2, 4) for _ in range(6)]  # kept alive: no address is reused for another input
    for x in xs[:3]:
        assert torch.equal(wrapped([x, w, 2])[0], x * w * 2)
    assert _FakeGraph.made == 1
    w.data = torch.randn(4)  # same object, new storage
    assert torch.equal(wrapped([xs[3], w, 2])[0], xs[3] * w * 2) and _FakeGraph.made == 2
    assert torch.equal(wrapped([xs[4], w, 3])[0], xs[4] * w * 3)  # another scalar: another signature
    assert torch.equal(wrapped([xs[5], w, 2])[0], xs[5] * w * 2)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_compiled_graphs_empty_their_input_list(cuda_graphs):
    """aot_autograd hands a backward graph the saved activations in a list; unless the graph empties it, they
    all stay alive until the backward ends."""
    from resfuse.capture.backend import compile_graph
    from resfuse.config import Config
    from resfuse.passes.report import Report

    gm = torch.fx.symbolic_trace(lambda a, b: (torch.relu(a) + b,))
    fn = compile_graph(gm, [torch.randn(4), torch.randn(4)], config=Config(cuda_graphs=cuda_graphs),
                       graph="backward", report=Report())
    a, b = torch.randn(4), torch.randn(4)
    want, seen = torch.relu(a) + b, weakref.ref(a)
    inputs = [a, b]
    del a
    (out,) = fn(inputs)
    assert inputs == [] and seen() is None and torch.equal(out, want)


def test_by_default_only_inference_graphs_on_cuda_replay():
    """cuda_graphs=None (Config's default): an inference graph on CUDA replays (its outputs are its own, as in
    eager); training's graphs, whose outputs would live in the graph's pool, and CPU graphs do not. True and False
    decide alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from resfuse.capture.cuda_graphs import wanted
    from resfuse.config import Config

    with FakeTensorMode():
        gpu = [torch.empty(2, device="cuda"), 3]
    cpu = [torch.empty(2)]
    default = Config().cuda_graphs
    assert default is None
    assert [wanted(default, g, gpu) for g in ("inference", "forward", "backward")] == [True, False, False]
    assert not wanted(default, "inference", cpu)
    assert all(wanted(True, g, cpu) for g in ("inference", "forward", "backward"))
    assert not any(wanted(False, g, gpu) for g in ("inference", "forward", "backward"))


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_default_compile_replays_inference_and_returns_fresh_outputs(monkeypatch):
    """resfuse.compile(model) with no options: the inference graph replays through CudaGraphed, and each call's
    output is its own tensor, untouched by the next call, as in eager."""
    block, compiled, xs = _compiled_block(monkeypatch, 4)
    with torch.no_grad():
        outs = [compiled(x) for x in xs]
        for x, out in zip(xs, outs):
            assert rel(out.float(), block(x).float()) < 5e-3
    assert len(_COMPILED_CALLS) == 4 and len({o.data_ptr() for o in outs}) == 4


_COMPILED_CALLS = []  # the CudaGraphed of each call of _compiled_block's model


def _compiled_block(monkeypatch, inputs: int):
    """(a fp16 channels_last Block, it under resfuse.compile with its defaults and no tuning, `inputs` inputs);
    each call of the compiled Block's inference graph appends its CudaGraphed to _COMPILED_CALLS."""
    _COMPILED_CALLS.clear()
    real = CudaGraphed.__call__
    monkeypatch.setattr(CudaGraphed, "__call__", lambda self, args: _COMPILED_CALLS.append(self) or real(self, args))
    torch.manual_seed(0)
    block = Block().eval().cuda().half().to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    xs = [torch.randn(2, 8, 9, 7, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
          for _ in range(inputs)]
    return block, resfuse.compile(block, tuning="none"), xs


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_handed_out_outputs_match_eager_and_outlive_the_next_call(monkeypatch):
    """Real CUDA graphs under resfuse.compile: in a loop that holds the last output while it makes the next, two
    handout graphs alternate, each output matches eager, and the one held is untouched by the next call; dropped
    outputs free their handout, and outputs all kept are copies that later calls leave alone."""
    block, compiled, xs = _compiled_block(monkeypatch, 8)
    with torch.no_grad():
        refs = [block(x) for x in xs]
        held = held_want = None
        for x, ref in zip(xs, refs):
            out = compiled(x)
            if held is not None:
                assert torch.equal(held, held_want)
            assert rel(out.float(), ref.float()) < 5e-3
            held, held_want = out, out.clone()
        handouts = _COMPILED_CALLS[-1].last.handouts
        assert len(handouts) == 2 and sum(h.free() for h in handouts) == 1
        del held, out
        assert all(h.free() for h in handouts)
        kept = [compiled(x) for x in xs]
        for k, ref in zip(kept, refs):
            assert rel(k.float(), ref.float()) < 5e-3


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_replay_matches_eager_on_fresh_inputs():
    torch.manual_seed(0)
    block = Block().eval().cuda().half().to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(block, cuda_graphs=True, tuning="none")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 8, 9, 7, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
            assert rel(compiled(x).float(), block(x).float()) < 5e-3


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_training_steps_under_graph_trees_match_eager():
    """Forward and backward replayed through CUDA graph trees: losses, gradients, updated weights and running
    stats track eager's over a few SGD steps on fresh batches."""
    from resfuse.ops import PATHS

    compiled = _train_against_eager(None, 1e-3)

    assert not [n for n in compiled.resfuse_report.notes if "without CUDA graphs" in n], compiled.resfuse_report.notes
    assert PATHS[("batch_norm_backward", "", "triton")] > 0  # graphed with our batch-norm backward kernel


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_split_launches_under_graph_trees_match_eager():
    """Every Triton conv and GEMM split in two (Config.split_k), so their tickets are taken during the graph trees'
    warm-up (kept per stream, allocated outside the trees' pool: kernels/split_k.py) and capture (a zeroed buffer
    a launch), then replayed: the steps still track eager's."""
    from resfuse import kernels
    from resfuse.kernels import split_k

    try:
        _train_against_eager(None, 1e-3, split_k=2)
    finally:
        kernels.set_options(split_k=None)  # the compile set it process-wide
    assert split_k._STREAMS and not any(t.any() for t in split_k._STREAMS.values())


def _fake_cuda_graph(fn):
    """fn traced on two fake CUDA tensors (no GPU needed), with the 'val' metadata aot_autograd's graphs carry."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        return make_fx(fn)(torch.empty(4, device="cuda"), torch.empty(4, device="cuda"))


@pytest.mark.parametrize("fn, why", [
    (lambda x, y: (torch.relu(x) + y,), None),
    (lambda x, y: (x.add_(y),), "writes in place to input(s) [0]"),
    (lambda x, y: (x.cpu() + 1,), "cpu device"),
])
def test_refusal_names_what_a_replay_cannot_do(fn, why):
    from resfuse.capture import cuda_graphs

    got = cuda_graphs.refusal(_fake_cuda_graph(fn), "inference")
    assert (got is None) if why is None else (why in got)


def test_a_refused_graph_runs_as_it_is_and_its_backward_follows_its_forward():
    from resfuse.capture import cuda_graphs

    gm = torch.fx.symbolic_trace(lambda a: (a * 2,))
    graphed = {}
    assert cuda_graphs.wrap(gm, gm, [], "inference", "cpu device", graphed) is gm
    assert cuda_graphs.wrap(gm, gm, [], "forward", "cpu device", graphed) is gm and graphed == {"forward": False}
    assert cuda_graphs.wrap(gm, gm, [], "backward", None, graphed) is gm  # its forward is not graphed: neither is it


def test_a_view_at_a_read_in_place_address_does_not_replay_the_wrong_graph(monkeypatch):
    """An input passed as the same tensor twice is read in place; a narrower view of its buffer later has the
    same address but another shape: it must get its own graph, not the first one's replay."""
    _fake_cuda(monkeypatch)

    def fn(args):
        (x,) = args
        out = x * 2
        if _FakeGraph.capturing is not None:
            _FakeGraph.capturing.work = lambda: out.copy_(x * 2)
        return [out]

    class OnCuda(CudaGraphed):
        @staticmethod
        def _on_cuda(args):
            return True

    wrapped, buf = OnCuda(fn), torch.randn(4, 3)
    for _ in range(3):
        assert torch.equal(wrapped([buf])[0], buf * 2)
    view = buf[:2]
    assert view.data_ptr() == buf.data_ptr()
    for _ in range(3):
        assert torch.equal(wrapped([view])[0], view * 2)


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_dependent_launches_in_a_graph_wait_for_their_producer():
    """A chain of fused GEMMs, each reading the previous one's output and writing over a buffer the one before
    it read, replayed from a CUDA graph with programmatic dependent launch on Hopper: every replay equals the
    float64 chain, so no kernel read its input, or wrote its output, before its producer had finished."""
    from resfuse import kernels
    from resfuse.kernels import launch, plan as plans

    kernels.set_options(pdl=True)
    torch.manual_seed(0)
    dev, m, n, layers = torch.device("cuda"), 8192, 256, 12
    ws = [torch.randn(n, n, device=dev, dtype=torch.half) / n ** 0.5 for _ in range(layers)]
    bs = [torch.randn(n, device=dev, dtype=torch.half) for _ in range(layers)]
    bufs = [torch.empty(m, n, device=dev, dtype=torch.half) for _ in range(3)]  # reused round-robin
    sig = "add(relu(add(acc,c0)),full1)"

    def chain(x):
        bufs[0].copy_(x)
        for i in range(layers):
            src, dst = bufs[i % 3], bufs[(i + 1) % 3]
            launch.gemm(src, ws[i], [bs[i], src], sig, dst)
        return bufs[layers % 3]

    x = torch.randn(m, n, device=dev, dtype=torch.half)
    chain(x)  # builds the plans and compiles the kernels outside the capture
    plan = next(p for k, p in launch._PLANS.items() if k[0] == "gemm" and k[1] == sig)
    assert plan.meta["PDL"] == (torch.cuda.get_device_capability() >= (9, 0) and plans._pdl_supported(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for _ in range(3):
        x.copy_(torch.randn(m, n, device=dev, dtype=torch.half))
        for b in bufs[1:]:
            b.fill_(float("nan"))
        graph.replay()
        ref = x.double()
        for w, b in zip(ws, bs):
            ref = torch.relu(ref.half().double() @ w.double() + b.double()) + ref.half().double()
        assert rel(out.double(), ref) < 2e-3


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_fp16_training_steps_take_the_statistics_from_the_conv():
    """Under autocast the convs feeding batch norms run cuDNN's conv + genstats (when nvidia-cudnn-frontend is
    installed), replayed through CUDA graph trees: losses, weights and running stats track eager's."""
    from resfuse.ops import PATHS
    from resfuse.providers import cudnn

    PATHS.clear()
    compiled = _train_against_eager(torch.float16, 2e-2)
    if cudnn._cudnn() is not None:
        assert PATHS[("conv2d_stats", "", "cudnn")] > 0, (PATHS, compiled.resfuse_report.rejected)


def _train_against_eager(autocast, tol, **options):
    """Four SGD steps on fresh batches through Block eagerly and through resfuse with CUDA graph trees (under
    autocast to `autocast` if given; other Config `options`): losses, weights and running stats must agree to
    `tol`. Returns the compiled module."""
    import copy

    torch.manual_seed(0)
    eager = Block().cuda().to(memory_format=torch.channels_last).train()
    mine = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = resfuse.compile(mine, **{"cuda_graphs": True, "tuning": "none", **options})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, mine)]
    for _ in range(4):
        x = torch.randn(4, 8, 9, 7, device="cuda").to(memory_format=torch.channels_last)
        losses = []
        for model, opt in zip((eager, compiled), opts):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=autocast or torch.float16, enabled=autocast is not None):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= tol * abs(losses[0]) + 1e-5
    for (name, p), q in zip(eager.named_parameters(), mine.parameters()):
        assert rel(q, p) < tol, name
    assert rel(mine.b2.running_var, eager.b2.running_var) < tol
    return compiled


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_an_eval_model_called_with_grad_enabled_runs_right_and_says_how_to_be_fast():
    """Autograd recording makes training graphs, which replay no CUDA graphs by default: the report says so, and
    how to get the inference graph; the numbers still match eager's."""
    torch.manual_seed(0)
    block = Block().cuda().half().to(memory_format=torch.channels_last).eval()
    torch._dynamo.reset()
    compiled = resfuse.compile(block, tuning="none")
    x = torch.randn(2, 8, 9, 7, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    out = compiled(x)
    with torch.no_grad():
        assert rel(out.detach().float(), block(x).float()) < 5e-3
    assert any("torch.no_grad()" in n for n in compiled.resfuse_report.notes), compiled.resfuse_report.notes


def test_a_graph_that_does_not_reproduce_its_warm_up_is_dropped(monkeypatch):
    """A captured graph whose replay computes something else than the un-graphed call on the same inputs (the
    thirty-eighth session's ResNet-50 bs1 graph on an H200) never serves a call: that signature runs without CUDA
    graphs from then on, with the right values, said in the report's errors; another signature's good graph
    still replays (fake CUDA graphs)."""
    from resfuse.capture.cuda_graphs import mismatch

    _fake_cuda(monkeypatch)
    calls = []
    fn = _product(calls, replay_adds=lambda batch: 1.0 if batch == 3 else 0.0)  # batch 3's graph replays wrong

    class OnCuda(CudaGraphed):
        @staticmethod
        def _on_cuda(args):
            return True

    class Report:
        errors = []

    wrapped, w = OnCuda(fn, Report), torch.randn(4)
    kept = []
    for step in range(8):  # batch 2 and 3 in turn: first calls, captures, then replays (2) or plain calls (3)
        x = torch.randn(2 + step % 2, 4)
        kept.append(x)
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert len(Report.errors) == 1 and "relative error" in Report.errors[0]
    assert [c for c in calls[6:] if c == 2] == []  # batch 2 replays its graph: fn ran only for batch 3
    assert calls.count(3) == 6  # batch 3: its first call; at its second the warm-up, the capture and a plain call;
    # then a plain call at each of its two later calls
    assert mismatch([torch.tensor([1.0, float("nan")])], [torch.tensor([1.0, float("nan")])]) is None
    assert "NaN" in mismatch([torch.tensor([1.0, float("nan")])], [torch.tensor([1.0, 2.0])])
    assert mismatch([torch.tensor([1, 2])], [torch.tensor([1, 3])]) == "output 0 differs"
    inf = float("inf")  # an infinity where the warm-up has the same agrees (it read as a NaN error, a false alarm)
    assert mismatch([torch.tensor([1.0, inf, -inf])], [torch.tensor([1.0, inf, -inf])]) is None
    assert "infinity" in mismatch([torch.tensor([1.0, inf])], [torch.tensor([1.0, -inf])])
    assert "infinity" in mismatch([torch.tensor([1.0, inf])], [torch.tensor([1.0, 3.0])])
    assert "relative error" in mismatch([torch.tensor([1.0, inf])], [torch.tensor([2.0, inf])])


class _OnCuda(CudaGraphed):
    @staticmethod
    def _on_cuda(args):
        return True


def test_outputs_are_handed_out_only_while_the_caller_holds_none_of_them(monkeypatch):
    """A call returns a handout graph's buffers only where nothing the caller holds reads them: dropped outputs let
    one handout serve every call; `out = model(x)` holds one output while it makes the next, and two alternate; a
    caller that keeps every output, or only a view of one, or only its storage, gets outputs that later calls never
    overwrite (fake CUDA graphs; every input kept alive, so no address is reused)."""
    _fake_cuda(monkeypatch)
    calls, w = [], torch.randn(4)
    xs = [torch.randn(3, 4) for _ in range(30)]
    wrapped = _OnCuda(_product(calls))
    for x in xs[:6]:  # the first call, the capture, then replays whose outputs are dropped at once
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert (_FakeGraph.made, _FakeGraph.shared, len(calls)) == (1, 1, 4)  # fn: first call, warm-up, 2 captures

    held, want = wrapped([xs[6], w])[0], xs[6] * w
    for x in xs[7:12]:  # `out = model(x)`: the last output is held during the call
        out = wrapped([x, w])[0]
        assert torch.equal(held, want) and torch.equal(out, x * w)
        held, want = out, x * w
    assert (_FakeGraph.made, _FakeGraph.shared, len(calls)) == (1, 2, 5)

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
    assert (_FakeGraph.made, _FakeGraph.shared, len(calls)) == (1, 2, 5)  # no more captures, no plain calls
    del kept, view, storage
    for x in xs[26:]:  # everything dropped: the handouts serve again
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert all(h.free() for h in wrapped.last.handouts)


def test_a_handout_that_does_not_reproduce_the_first_graph_is_dropped(monkeypatch):
    """A handout graph whose replay differs from the first graph's on the same inputs never serves a call: the
    signature's calls copy the first graph's outputs instead, said in the report's errors (fake CUDA graphs)."""
    _fake_cuda(monkeypatch)
    captures = []

    def fn(args):
        x, w = args
        out = x * w
        if _FakeGraph.capturing is not None:
            captures.append(1)
            extra = 1.0 if len(captures) == 2 else 0.0  # the second capture, the first handout, replays wrong
            _FakeGraph.capturing.work = lambda: out.copy_(x * w + extra)
        return [out]

    class Report:
        errors = []

    wrapped, w = _OnCuda(fn, Report), torch.randn(4)
    xs = [torch.randn(3, 4) for _ in range(6)]
    for x in xs:
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert len(Report.errors) == 1 and "copies its outputs out" in Report.errors[0]
    assert wrapped.last.handouts == [] and _FakeGraph.shared == 1


def test_outputs_over_the_handout_size_are_copied_after_each_replay(monkeypatch):
    """A signature whose outputs pass HANDOUT_BYTES captures no handout graph: its calls replay the first graph and
    copy the outputs out, every one right; a smaller signature of the same function still hands out (fake CUDA
    graphs)."""
    from resfuse.capture.cuda_graphs import handout_refusal

    _fake_cuda(monkeypatch)
    calls = []

    class Small(_OnCuda):
        HANDOUT_BYTES = 3 * 4 * 4  # a [3, 4] fp32 output fits, a [5, 4] one does not

    wrapped, w = Small(_product(calls)), torch.randn(4)
    kept = []
    for rows in (5, 5, 5, 5, 3, 3, 3, 3):
        x = torch.randn(rows, 4)
        kept.append(x)
        assert torch.equal(wrapped([x, w])[0], x * w)
    refused = {sig[0][0][0]: cap.handouts_refused for sig, cap in wrapped.captures.items()}
    assert refused[5] == "outputs of 80 bytes, over 48" and refused[3] is None
    assert (_FakeGraph.made, _FakeGraph.shared) == (2, 1)
    assert handout_refusal([torch.empty(2), None, 3], 8) is None


def test_a_handout_copies_every_tensor_output_and_keeps_the_others(monkeypatch):
    """Outputs of several tensors and a non-tensor: a handout copies each tensor into its own buffer and returns
    the non-tensor as it is; an output kept holds its handout whole (fake CUDA graphs)."""
    _fake_cuda(monkeypatch)

    def fn(args):
        x, w = args
        prod, total = x * w, x + w
        if _FakeGraph.capturing is not None:
            _FakeGraph.capturing.work = lambda: (prod.copy_(x * w), total.copy_(x + w))
        return [prod, None, total]

    wrapped, w = _OnCuda(fn), torch.randn(4)
    xs = [torch.randn(3, 4) for _ in range(8)]
    held = want = None
    for x in xs:
        out = wrapped([x, w])
        assert out[1] is None and torch.equal(out[0], x * w) and torch.equal(out[2], x + w)
        if held is not None:  # only the second tensor of the last call's outputs is held: its handout is not free
            assert torch.equal(held, want)
        held, want = out[2], x + w
        del out
    assert _FakeGraph.shared == 2


@settings(max_examples=40, deadline=None)
@given(keeps=st.lists(st.sampled_from(["drop", "tensor", "view", "storage"]), min_size=3, max_size=14),
       data=st.data())
def test_whatever_a_caller_keeps_no_later_call_overwrites(keeps, data):
    """A random run of calls, each output dropped or kept (whole, as a view, or as its storage alone), and some kept
    ones let go along the way: every call returns its own right values, and every output still kept reads at the end
    what its call returned (fake CUDA graphs; outputs and inputs of distinct values a call)."""
    mp = pytest.MonkeyPatch()
    try:
        _fake_cuda(mp)
        wrapped, w = _OnCuda(_product([])), torch.randn(4)
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
