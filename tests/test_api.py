"""Public API: the backend by name, resfuse.compile, switches, fallbacks for bad input, channels_last."""
import copy

import pytest
import torch
import torch.nn as nn

import resfuse


class Block(nn.Module):
    """A bottleneck-style block: conv-bn-relu, conv-bn, + shortcut conv-bn, relu; then a linear head."""

    def __init__(self, c=8):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, 2 * c, 1, bias=False), nn.BatchNorm2d(2 * c)
        self.cs, self.bs = nn.Conv2d(c, 2 * c, 1, stride=1, bias=False), nn.BatchNorm2d(2 * c)
        self.fc = nn.Linear(2 * c, 5)
        for bn in (self.b1, self.b2, self.bs):
            bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 1.5), bn.weight.data.normal_()

    def forward(self, x):
        y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
        y = torch.relu(y + self.bs(self.cs(x)))
        return torch.relu(self.fc(y.mean((2, 3))))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def block():
    torch.manual_seed(0)
    return Block().eval()


def test_backend_by_name_matches_eager(block):
    x = torch.randn(2, 8, 9, 7)
    torch._dynamo.reset()
    with torch.no_grad():
        out, ref = torch.compile(block, backend="resfuse")(x), block(x)
    assert rel(out, ref) < 1e-5
    report = resfuse.last_report()
    assert sorted(f.pattern for f in report.fusions) == ["conv2d_bn", "conv2d_bn_add_relu", "conv2d_bn_relu",
                                                         "gemm_bias_relu"]
    assert {f.ran for f in report.fusions} == {"reference"} and {f.provider for f in report.fusions} == {"aten"}


@pytest.mark.parametrize("guards", ["all", "tensors only"])
def test_a_guard_filter_reaches_dynamo(block, guards):
    """resfuse.compile passes torch.compile's guard_filter_fn on: without the modules' guards, switching the model
    to training mode is not seen (the unsafe trade a user opts into for less host time a call); with them, it
    captures again."""
    from torch._dynamo.utils import counters

    x = torch.randn(2, 8, 9, 7)
    torch._dynamo.reset()
    unsafe = guards == "tensors only"
    compiled = resfuse.compile(block, guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe
                               if unsafe else None)
    with torch.no_grad():
        assert rel(compiled(x), block(x)) < 1e-5
        graphs = counters["stats"]["unique_graphs"]
        block.train()
        compiled(x)
    assert counters["stats"]["unique_graphs"] - graphs == (0 if unsafe else 1)


@pytest.mark.parametrize("epilogue", [True, False])
@pytest.mark.parametrize("add_to_output", [True, False])
def test_switches_change_the_graph_not_the_result(block, epilogue, add_to_output):
    x = torch.randn(2, 8, 9, 7)
    torch._dynamo.reset()
    compiled = resfuse.compile(block, fuse_epilogue=epilogue, fuse_add_to_output=add_to_output)
    with torch.no_grad():
        assert rel(compiled(x), block(x)) < 1e-5
    patterns = sorted(f.pattern for f in compiled.resfuse_report.fusions)
    expected = {(True, True): ["conv2d_bn", "conv2d_bn_add_relu", "conv2d_bn_relu", "gemm_bias_relu"],
                (True, False): ["conv2d_bn", "conv2d_bn", "conv2d_bn_relu", "gemm_bias_relu"],
                (False, True): [], (False, False): []}[(epilogue, add_to_output)]
    assert patterns == expected
    if not add_to_output:
        assert any("fuse_add_to_output is off" in r.reason for r in compiled.resfuse_report.rejected)


def test_add_to_output_alone_turns_mm_into_addmm():
    a, b, r = torch.randn(5, 6), torch.randn(6, 4), torch.randn(5, 4)
    torch._dynamo.reset()
    compiled = resfuse.compile(lambda a, b, r: torch.mm(a, b) + r, fuse_epilogue=False)
    torch.testing.assert_close(compiled(a, b, r), a @ b + r)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_unsupported_dtype_falls_back_and_is_reported(dtype):
    torch._dynamo.reset()
    if dtype.is_floating_point:
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval().to(dtype)
        x = torch.randn(1, 3, 6, 6, dtype=dtype)
        fn = m
    else:
        x = torch.randint(-5, 5, (4, 4))
        fn = lambda x: torch.relu(torch.mm(x, x))  # noqa: E731
    compiled = resfuse.compile(fn)
    with torch.no_grad():
        assert torch.equal(compiled(x), fn(x)) if not dtype.is_floating_point else rel(compiled(x), fn(x)) < 1e-12
    report = compiled.resfuse_report
    assert report.fusions == [] and any("not supported" in r.reason for r in report.rejected)


def test_dynamic_shapes_fall_back_and_are_reported(block):
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="resfuse", dynamic=True)
    with torch.no_grad():
        for h in (9, 11):
            x = torch.randn(2, 8, h, 7)
            assert rel(compiled(x), block(x)) < 1e-5
    assert any("dynamic shape" in r.reason for r in resfuse.last_report().rejected)


def test_channels_last_survives_without_layout_conversions(block):

    from torch._dynamo.backends.common import aot_autograd

    from resfuse.capture.backend import compile_graph
    from resfuse.config import Config
    from resfuse.passes.report import Report

    block = block.to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 9, 7).to(memory_format=torch.channels_last)
    captured = []

    def inference(gm, inputs):
        captured.append(compile_graph(gm, inputs, config=Config(), graph="inference", report=Report()))
        return captured[-1]

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(block, backend=aot_autograd(fw_compiler=inference, inference_compiler=inference))(x)
    assert rel(out, block(x)) < 1e-5
    (gm,) = captured
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert not any("clone" in t or "contiguous" in t or "_to_copy" in t for t in targets), targets
    from resfuse.ops.fused import conv2d_impl

    convs = [n for n in gm.graph.nodes if n.target is conv2d_impl]  # lowered from torch.ops.resfuse.conv2d
    assert len(convs) == 3 and all(n.meta["val"].is_contiguous(memory_format=torch.channels_last) for n in convs)


def test_explain_reports_without_running_fused_ops(block):
    x = torch.randn(2, 8, 9, 7)
    report = resfuse.explain(block, x)
    assert len(report.fusions) == 4 and {f.ran for f in report.fusions} == {"not run"}
    add = next(f for f in report.fusions if "add" in f.ops)
    assert add.ops == ["bn", "add", "relu"] and add.anchor == "conv2d"
    assert add.bytes_saved == 6 * 2 * 16 * 9 * 7 * 4  # bn 2N + add 3N + relu 2N, minus the residual read N
    assert "conv2d_bn_add_relu" in str(report)


def test_training_graphs_are_fused_and_match_eager(block):
    """Training: both graphs are rewritten (training batch norm, dgrad) and gradients and running stats equal
    eager's (tests/models/test_training.py runs whole models)."""
    import copy

    block.train()
    twin = copy.deepcopy(block)
    x = torch.randn(2, 8, 9, 7)
    torch._dynamo.reset()
    compiled = resfuse.compile(block)
    compiled(x).square().sum().backward()
    twin(x).square().sum().backward()
    for (name, p), q in zip(block.named_parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) < 1e-4, name
    assert torch.allclose(block.b1.running_mean, twin.b1.running_mean)
    report = compiled.resfuse_report
    assert report.graphs == ["forward", "backward"]
    assert {f.anchor for f in report.fusions if f.graph == "forward"} >= {"batch_norm"}
    assert {f.anchor for f in report.fusions if f.graph == "backward"} >= {"conv2d_dgrad"}


def test_odd_input_layout_never_gives_a_wrong_number(block):
    x = torch.randn(2, 8, 7, 9).transpose(2, 3)  # neither contiguous nor channels_last
    torch._dynamo.reset()
    compiled = resfuse.compile(block)
    with torch.no_grad():
        assert rel(compiled(x), block(x)) < 1e-5


def test_a_linear_on_a_1d_input_and_batch_norm_without_affine():
    """Edge cases found by fuzzing: a linear layer on a 1-D input (aot's [1, N] product viewed back to [N]: the
    view is not absorbed; it crashed the fused op) and training batch norm with affine=False (no weight: the
    report's shapes crashed the passes, and the graph ran unfused)."""
    import resfuse

    torch.manual_seed(3)
    lin = nn.Sequential(nn.Linear(6, 5), nn.ReLU())
    torch._dynamo.reset()
    compiled = resfuse.compile(lin)
    x = torch.randn(6)
    assert compiled(x).shape == (5,) and rel(compiled(x), lin(x)) < 1e-6
    assert [f.pattern for f in compiled.resfuse_report.fusions] == ["gemm_bias"]
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, affine=False), nn.ReLU()).train()
    twin = copy.deepcopy(net)
    torch._dynamo.reset()
    compiled = resfuse.compile(net)
    x = torch.randn(2, 3, 5, 5)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled(x1).square().sum().backward()
    twin(x2).square().sum().backward()
    report = compiled.resfuse_report
    assert not report.errors and any(f.anchor == "batch_norm" for f in report.fusions)
    assert rel(x1.grad, x2.grad) < 1e-4 and rel(net[0].weight.grad, twin[0].weight.grad) < 1e-4


def test_an_empty_batch_gives_empty_outputs_and_gradients():
    """A batch of 0 (the fused ops' [S, P, C] view reshaped with -1 was ambiguous and raised)."""
    import resfuse

    torch.manual_seed(4)
    for net, shape in ((nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()), (0, 4, 5, 5)),
                       (nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (0, 3, 8))):
        torch._dynamo.reset()
        compiled = resfuse.compile(net)
        x = torch.randn(shape, requires_grad=True)
        out = compiled(x)
        assert out.shape == net(x).shape and out.numel() == 0
        out.sum().backward()
        assert x.grad.shape == x.shape
        assert compiled.resfuse_report.fusions and not compiled.resfuse_report.errors


def test_a_compiled_call_makes_no_reference_cycles(block):
    """A fused op's per-call Python (its epilogue's operands, the unfused reference, the batch-norm fold's tree
    rewrite) makes no reference cycle: a cycle keeps that call's tensors alive until the garbage collector runs,
    and the collections cost host time on every call (a recursive closure did both)."""
    import gc

    compiled = resfuse.compile(block)
    x = torch.randn(2, 8, 9, 7)
    with torch.no_grad():
        want = block(x)
        for _ in range(2):
            compiled(x)
        windows = []
        for _ in range(2):  # the first window may also free what earlier tests' compiles left (their FakeTensors)
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for _ in range(3):
                    got = compiled(x)
                gc.collect()
                windows.append([type(o).__name__ for o in gc.garbage])
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
        garbage = windows[1]
    assert rel(got, want) < 1e-4 and len(compiled.resfuse_report.fusions) >= 3
    assert garbage == [], garbage[:20]


def test_each_compiled_model_runs_under_its_own_settings(tmp_path, monkeypatch):
    """The kernels' and the tuner's settings live in module state: a model compiled later with others (no tuning,
    PDL off, another cache) must not change what an earlier model's ops run with, in inference or training."""
    import copy

    from resfuse import kernels
    from resfuse.ops import fused, training
    from resfuse.tuning import choose

    seen = []

    def spy(real):
        def run(*args):
            seen.append((kernels.options()["pdl"], choose.level_now(), kernels.options()["cache_dir"]))
            return real(*args)
        return run

    for module, name in ((fused, "_conv2d"), (fused, "_gemm"), (training, "_dgrad")):  # what asks the tuner
        monkeypatch.setattr(module, name, spy(getattr(module, name)))
    torch.manual_seed(1)  # both heads' relus let something through
    a, b = Block().eval(), Block().eval()
    twin = copy.deepcopy(a).train()
    torch._dynamo.reset()
    mine = {"a": resfuse.compile(a, pdl=True, tuning="max", cache_dir=str(tmp_path / "a")),
            "b": resfuse.compile(b, pdl=False, tuning="none", cache_dir=str(tmp_path / "b")),
            "train": resfuse.compile(twin, pdl=False, tuning="fast", cache_dir=str(tmp_path / "t"))}
    want = {"a": (True, "max", str(tmp_path / "a")), "b": (False, "none", str(tmp_path / "b")),
            "train": (False, "fast", str(tmp_path / "t"))}
    x = torch.randn(2, 8, 9, 7)
    for name in ("a", "b", "train", "a", "train", "b", "a"):
        seen.clear()
        if name == "train":
            mine[name](x).square().mean().backward()
        else:
            with torch.no_grad():
                assert rel(mine[name](x), {"a": a, "b": b}[name](x)) < 1e-5
        assert seen and set(seen) == {want[name]}, (name, seen)


def test_a_graph_whose_passes_fail_runs_as_captured_and_says_why(monkeypatch):
    """Never crash the user's model: a pass that raises leaves each graph (inference, or forward and backward) as
    aot captured it, run unfused, with the error in the report and a warning."""
    import copy

    from resfuse.capture import backend

    def broken(gm, ctx):
        raise RuntimeError("a pass broke")

    monkeypatch.setattr(backend, "run_passes", broken)
    torch.manual_seed(1)
    net = Block()
    twin = copy.deepcopy(net)
    x = torch.randn(2, 8, 9, 7)
    for training in (False, True):
        net.train(training), twin.train(training)
        torch._dynamo.reset()
        compiled = resfuse.compile(net)
        with pytest.warns(UserWarning, match="passes failed"), torch.set_grad_enabled(training):
            out = compiled(x)
        ref = twin(x)
        assert rel(out, ref) < 1e-6
        if training:
            out.square().sum().backward()
            ref.square().sum().backward()
            for p, q in zip(net.parameters(), twin.parameters()):
                assert rel(p.grad, q.grad) < 1e-5
        errors = compiled.resfuse_report.errors
        graphs = ("forward", "backward") if training else ("inference",)
        assert [e.split(":")[0] for e in errors] == [f"{g} graph" for g in graphs], errors
        assert all("passes failed, running it unfused: RuntimeError: a pass broke" in e for e in errors)
        assert not compiled.resfuse_report.fusions
