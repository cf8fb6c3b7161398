"""Config.remainder: the ops no fusion absorbed compiled by Inductor (its C++ backend on this CPU), with our fused
ops running their Triton kernels under the interpreter, called from Inductor's code."""
import copy

import pytest
import torch
import torch.nn as nn

import resfuse
from resfuse.capture import inductor

from .test_api import rel


class SqueezeExcite(nn.Module):
    """conv-bn-relu whose output is gated by a squeeze-excite branch, then max-pooled: the mean, the sigmoid, the
    gating mul and the add stay in the remainder (the gated value has two readers)."""

    def __init__(self, c=6):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.squeeze, self.excite = nn.Conv2d(c, 3, 1), nn.Conv2d(3, c, 1)
        self.pool, self.head = nn.MaxPool2d(3, 2, 1), nn.Linear(c, 4)
        self.bn.running_mean.normal_(), self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        gate = torch.sigmoid(self.excite(torch.relu(self.squeeze(y.mean((2, 3), keepdim=True)))))
        y = self.pool(y * gate + x)
        return self.head(y.mean((2, 3)))


@pytest.fixture
def compiled_graphs(monkeypatch):
    """The graph kinds whose remainder Inductor compiled."""
    seen = []
    compile_remainder = inductor.compile_remainder

    def spy(gm, example_inputs, graph):
        out = compile_remainder(gm, example_inputs, graph)
        seen.append(graph)
        return out

    monkeypatch.setattr(inductor, "compile_remainder", spy)
    return seen


def test_auto_sends_cuda_graphs_to_inductor_and_keeps_cpu_graphs_eager():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu = [torch.randn(2)]
    with FakeTensorMode():
        cuda = [torch.empty(2, device="cuda")]
    assert inductor.wanted("auto", cuda) and not inductor.wanted("auto", cpu)
    assert inductor.wanted("inductor", cpu) and not inductor.wanted("eager", cuda)
    with pytest.raises(ValueError, match="remainder='Inductor'"):
        resfuse.Config(remainder="Inductor")


def test_inference_through_inductor_matches_eager(compiled_graphs):
    torch.manual_seed(3)
    net = SqueezeExcite().eval().to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(net, interpret=True, remainder="inductor")
    with torch.no_grad():
        for batch in (2, 3):  # a second batch size recaptures with a symbolic batch: Inductor takes that too
            x = torch.randn(batch, 6, 9, 7).to(memory_format=torch.channels_last)
            assert rel(compiled(x), net(x)) < 1e-5
    report = compiled.resfuse_report
    assert compiled_graphs == ["inference", "inference"] and report.notes == [] and report.errors == []
    assert sum("no fusion absorbed compiled by Inductor" in r for r in report.rewrites) == 2
    assert {f.ran for f in report.fusions} == {"triton"} and len(report.fusions) >= 3


def test_training_through_inductor_matches_eager(compiled_graphs, monkeypatch):
    """Forward (batch-norm kernel, max-pool kernel) and backward (dgrads, batch-norm backward, the pool's
    backward): gradients and running statistics equal eager's, with the remainder compiled by Inductor, which
    gets the forward's running-stat copies as one foreach copy."""
    batched = []
    batch = inductor.batched_input_updates
    monkeypatch.setattr(inductor, "batched_input_updates", lambda gm: batched.append(batch(gm)) or batched[-1])
    torch.manual_seed(4)
    net = SqueezeExcite().train().to(memory_format=torch.channels_last)
    twin = copy.deepcopy(net)
    x = torch.randn(2, 6, 9, 7).to(memory_format=torch.channels_last).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    compiled = resfuse.compile(net, interpret=True, remainder="inductor")
    loss = compiled(x).square().sum()
    loss.backward()
    ref = twin(x2).square().sum()
    ref.backward()
    assert sorted(compiled_graphs) == ["backward", "forward"] and compiled.resfuse_report.notes == []
    assert rel(loss, ref) < 1e-5 and rel(x.grad, x2.grad) < 1e-4
    for (name, p), q in zip(net.named_parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) < 1e-4, name
    for (name, b), c in zip(net.named_buffers(), twin.buffers()):
        assert rel(b.float(), c.float()) < 1e-5, name
    assert "triton" in {f.ran for f in compiled.resfuse_report.fusions}
    foreach = [n for gm in batched for n in gm.graph.nodes if n.target is torch.ops.aten._foreach_copy_.default]
    assert len(foreach) == 1 and len(foreach[0].args[0]) == 2, [gm.code for gm in batched]  # running mean, var


def test_a_remainder_inductor_refuses_runs_eagerly_and_says_why(monkeypatch):
    def refuse(gm, example_inputs, graph):
        raise RuntimeError("no lowering for this op\nsecond line")

    monkeypatch.setattr(inductor, "compile_remainder", refuse)
    torch.manual_seed(5)
    net = SqueezeExcite().eval()
    x = torch.randn(2, 6, 8, 8)
    torch._dynamo.reset()
    compiled = resfuse.compile(net, interpret=True, remainder="inductor")
    with pytest.warns(UserWarning, match="Inductor refused"), torch.no_grad():
        out = compiled(x)
    assert rel(out, net(x)) < 1e-5
    (note,) = compiled.resfuse_report.notes
    assert note.startswith("inference graph: Inductor refused the remainder, running it eagerly: RuntimeError: "
                           "no lowering for this op second line")


class BiasOnly(nn.Module):
    """Convs whose epilogue is their bias alone, each read by an op no fusion takes (a LayerNorm over channels)."""

    def __init__(self, c=4):
        super().__init__()
        self.grouped, self.depthwise = nn.Conv2d(c, c, 3, padding=1, groups=2), nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.dense, self.norm = nn.Conv2d(c, c, 1), nn.LayerNorm(c)

    def forward(self, x):
        ln = lambda y: self.norm(y.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # noqa: E731
        return ln(self.dense(ln(self.depthwise(ln(self.grouped(x))))))


@pytest.mark.parametrize("remainder", ["inductor", "eager"])
def test_a_bias_alone_on_cudnn_is_left_to_inductor(remainder):
    """A grouped conv runs cuDNN (ATen here) + our bias kernel (the tuner's only choice for it, as it is wherever
    cuDNN wins the tuning): with Inductor compiling the rest the conv stays an ATen op, so that Inductor adds its
    bias inside the LayerNorm's kernel. The depthwise and the dense conv run our kernels and stay fused; with an
    eager remainder nothing would add the bias for free, so the grouped conv is fused too."""
    torch.manual_seed(6)
    net = BiasOnly().eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 6, 5).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(net, interpret=True, remainder=remainder)
    with torch.no_grad():
        assert rel(compiled(x), net(x)) < 1e-5
    report = compiled.resfuse_report
    groups = sorted(f.shapes["inputs"][0][1] // f.shapes["inputs"][1][1] for f in report.fusions)
    left = [r for r in report.rejected if "left to Inductor" in r.reason]
    if remainder == "inductor":
        assert groups == [1, 4] and len(left) == 1 and "(epilogue)" in left[0].reason
    else:
        assert groups == [1, 2, 4] and left == []



class Head(nn.Module):
    """A linear layer whose bias and residual add feed a LayerNorm: BERT's output projections."""

    def __init__(self, c=4):
        super().__init__()
        self.fc, self.norm = nn.Linear(c, c), nn.LayerNorm(c)

    def forward(self, z):
        return self.norm(self.fc(z) + z.sigmoid())


@pytest.mark.parametrize("remainder", ["inductor", "eager"])
def test_a_gemm_left_to_inductor_keeps_its_residual_add_there(remainder, monkeypatch):
    """The tuner choosing cuBLAS + our epilogue kernel, the linear's bias is left to Inductor, and FuseAddToOutput
    must not take the GEMM back for the residual add that follows (Inductor adds both inside the LayerNorm's
    kernel). With an eager remainder the GEMM fuses bias and add."""
    from resfuse.tuning import choose

    tuned = []
    monkeypatch.setattr(choose, "choose", lambda call: tuned.append(call.signature) or choose.UNTUNED)
    torch.manual_seed(7)
    net = Head().eval()
    z = torch.randn(6, 4)
    torch._dynamo.reset()
    compiled = resfuse.compile(net, interpret=True, remainder=remainder)
    with torch.no_grad():
        assert rel(compiled(z), net(z)) < 1e-5
    report = compiled.resfuse_report
    left = [r for r in report.rejected if "bias alone" in r.reason]
    if remainder == "inductor":
        assert tuned == ["add(acc,c0)"] and report.fusions == [] and len(left) == 2, left  # the addmm, the add
        assert {r.op for r in left} == {"aten.addmm.default", "aten.add.Tensor"}
    else:
        assert left == [] and [f.pattern for f in report.fusions] == ["gemm_bias_add"]


class BiasFreeHead(nn.Module):
    """A bias-free linear layer whose residual add feeds a norm: Llama's down and output projections."""

    def __init__(self, c=4):
        super().__init__()
        self.fc, self.norm = nn.Linear(c, c, bias=False), nn.LayerNorm(c)

    def forward(self, z):
        return self.norm(self.fc(z) + z.sigmoid())


@pytest.mark.parametrize("winner, switch", [("epilogue", True), ("triton", True), ("epilogue", False)])
def test_a_residual_add_on_cublas_is_left_to_inductor(winner, switch, monkeypatch):
    """FuseAddToOutput takes the bare GEMM's residual add; with the switch leave_adds_to_inductor on (off by
    default) and the tuner, asked at capture, choosing cuBLAS + our epilogue kernel, the add is left to Inductor
    instead (it adds it inside the norm's kernel). Our kernel winning, the GEMM fuses the add."""
    from resfuse.tuning import choose

    tuned = []
    pick = choose.UNTUNED if winner == "epilogue" else choose.HEURISTIC
    monkeypatch.setattr(choose, "choose", lambda call: tuned.append(call.signature) or pick)
    torch.manual_seed(8)
    net = BiasFreeHead().eval()
    z = torch.randn(6, 4)
    torch._dynamo.reset()
    compiled = resfuse.compile(net, interpret=True, remainder="inductor", leave_adds_to_inductor=switch)
    with torch.no_grad():
        assert rel(compiled(z), net(z)) < 1e-5
    report = compiled.resfuse_report
    left = [r for r in report.rejected if "residual add alone" in r.reason]
    if winner == "epilogue" and switch:
        assert tuned == ["add(acc,full0)"] and report.fusions == [] and len(left) == 1
        assert left[0].op == "aten.add.Tensor"
    else:
        assert left == [] and [f.pattern for f in report.fusions] == ["gemm_add"]
        assert tuned == ["add(acc,full0)"] * (1 + (switch and winner == "triton"))  # at capture, and at the call


def test_closing_state_updates_become_one_foreach_copy_per_dtype():
    """A training forward's closing copy_ run (running stats, counters) -> one _foreach_copy_ per dtype pair; the
    graph updates the same inputs to the same values; a copy_ before the closing run stays."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x, rm, rv, count, other):
        other.copy_(x[:2] * 3)  # not in the closing run: another op follows it
        y = x.sum() + other.sum()
        new_rm, new_count, new_rv = rm * 0.9 + x[:3] * 0.1, count + 1, rv * 0.9 + x[3:6].square() * 0.1
        rm.copy_(new_rm)  # aot_autograd's closing copies
        count.copy_(new_count)
        rv.copy_(new_rv)
        return (y,)

    def inputs():
        torch.manual_seed(0)
        return [torch.randn(8), torch.randn(3), torch.rand(3), torch.tensor(5), torch.zeros(2)]

    gm = make_fx(step)(*inputs())
    expected = inputs()
    gm(*expected)
    batched = inductor.batched_input_updates(make_fx(step)(*inputs()))
    targets = [n.target for n in batched.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten._foreach_copy_.default) == 1  # the fp32 pair; the lone int64 copy stays
    assert targets.count(torch.ops.aten.copy_.default) == 2
    foreach = next(n for n in batched.graph.nodes if n.target is torch.ops.aten._foreach_copy_.default)
    assert [a.name for a in foreach.args[0]] == ["rm_1", "rv_1"]
    got = inputs()
    out = batched(*got)
    assert torch.equal(out[0], gm(*inputs())[0])
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_combo_kernels_reach_inductor_for_training_graphs_only(monkeypatch):
    from torch._inductor import config as inductor_config

    seen = {}

    def record(gm, example_inputs, graph):
        seen[graph] = inductor_config.combo_kernels
        raise RuntimeError("recorded")  # the eager remainder runs instead

    monkeypatch.setattr(inductor, "compile_remainder", record)
    net = SqueezeExcite().to(memory_format=torch.channels_last)
    x = torch.randn(2, 6, 9, 7).to(memory_format=torch.channels_last)
    for mode in ("train", "eval"):
        torch._dynamo.reset()
        compiled = resfuse.compile(getattr(copy.deepcopy(net), mode)(), interpret=True, remainder="inductor",
                                   combo_kernels=True)
        with torch.set_grad_enabled(mode == "train"):
            out = compiled(x)
        if mode == "train":
            out.sum().backward()
    assert seen == {"forward": True, "backward": True, "inference": False}
    assert not inductor_config.combo_kernels
