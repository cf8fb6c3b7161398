"""cuda_graphs=True: replays match eager for fresh inputs, parameters are read in place (GPU only); compiled
graphs take the boxed calling convention, so a backward graph frees the saved activations it is handed."""
import weakref

import pytest
import torch

import resfuse
from resfuse.capture.cuda_graphs import CudaGraphed

from .fake_graphs import FakeGraph, OnCudaGraphed, fake_cuda, product
from .test_api import Block, rel


def test_cpu_inputs_run_the_function_as_it_is():
    seen = []
    wrapped = CudaGraphed(lambda a: seen.append(a) or [a[0] * 2])
    x = torch.randn(3)
    assert torch.equal(wrapped([x])[0], x * 2) and len(seen) == 1 and wrapped.graph is None


def test_each_input_signature_keeps_its_graph(monkeypatch):
    """A dynamic batch alternating between sizes replays each size's graph without capturing again; past
    MAX_SIGNATURES the least recently used graph goes; a moved parameter re-captures (fake CUDA graphs)."""
    fake_cuda(monkeypatch)
    calls = []
    fn = product(calls)

    class OnCuda(OnCudaGraphed):
        MAX_SIGNATURES = 2

    wrapped, w = OnCuda(fn), torch.randn(4)
    # every input kept alive: a freed one's address may come back for the next (the allocator's choice), and
    # an input seen twice at one address counts as static (read in place) until it moves, then captures again
    kept = []
    for step in range(6):  # batch sizes 2, 3, 2, 3, ...: two first calls, two captures, then replays only
        x = torch.randn(2 + step % 2, 4)
        kept.append(x)
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert FakeGraph.made == 2 and len(wrapped.captures) == 2
    ran = len(calls)
    for step in range(4):
        x = torch.randn(2 + step % 2, 4)
        kept.append(x)
        assert torch.equal(wrapped([x, w])[0], x * w)
    assert len(calls) == ran and FakeGraph.made == 2  # replays: the function itself never ran again
    x5 = torch.randn(5, 4)
    wrapped([x5, w])  # a third size: the least recently used (batch 2) goes
    assert {sig[0][0][0] for sig in wrapped.captures} == {3, 5}
    w2 = torch.randn(4)  # a parameter that moved: batch 3 captures again, and reads the new one
    x3 = torch.randn(3, 4)
    wrapped([x3, w2])
    assert torch.equal(wrapped([x3, w2])[0], x3 * w2) and FakeGraph.made == 3


def test_a_replay_checks_addresses_and_scalars_not_only_objects(monkeypatch):
    """The fast path compares input objects, then addresses: a parameter whose storage was swapped under the
    same object (`p.data = ...`) captures again and reads the new values; a scalar input (a dynamic size)
    that changed is not replayed with the old one's graph (fake CUDA graphs)."""
    fake_cuda(monkeypatch)

    def fn(args):
        x, w, k = args
        out = x * w * k
        if FakeGraph.capturing is not None:
            FakeGraph.capturing.work = lambda: out.copy_(x * w * k)
        return [out]

    wrapped, w = OnCudaGraphed(fn), torch.nn.Parameter(torch.randn(4), requires_grad=False)
    xs = [torch.randn(2, 4) for _ in range(6)]  # kept alive: no address is reused for another input
    for x in xs[:3]:
        assert torch.equal(wrapped([x, w, 2])[0], x * w * 2)
    assert FakeGraph.made == 1
    w.data = torch.randn(4)  # same object, new storage
    assert torch.equal(wrapped([xs[3], w, 2])[0], xs[3] * w * 2) and FakeGraph.made == 2
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
    fake_cuda(monkeypatch)

    def fn(args):
        (x,) = args
        out = x * 2
        if FakeGraph.capturing is not None:
            FakeGraph.capturing.work = lambda: out.copy_(x * 2)
        return [out]

    wrapped, buf = OnCudaGraphed(fn), torch.randn(4, 3)
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

    fake_cuda(monkeypatch)
    calls = []
    fn = product(calls, replay_adds=lambda batch: 1.0 if batch == 3 else 0.0)  # batch 3's graph replays wrong

    class Report:
        errors = []

    wrapped, w = OnCudaGraphed(fn, Report), torch.randn(4)
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
