"""The max-pool pass and aux outputs through whole compiles under the interpreter: random pool geometries and
layouts match eager forward and backward, refusals say why, and an aux output never lets an operand come
from one of its own readers."""
import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import resfuse
from resfuse.ops import PATHS

from .helpers import reasons, rel


class Pool(nn.Module):
    def __init__(self, kernel, stride, padding, dilation, ceil_mode, relu_first):
        super().__init__()
        self.pool = nn.MaxPool2d(kernel, stride, padding, dilation, ceil_mode=ceil_mode)
        self.relu_first = relu_first
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        x = x * self.scale
        return self.pool(torch.relu(x) if self.relu_first else x) * 2


@settings(max_examples=12, deadline=None)
@given(kernel=st.integers(1, 3), stride=st.integers(1, 3), dilation=st.integers(1, 2), ceil_mode=st.booleans(),
       relu_first=st.booleans(), channels_last=st.booleans(), size=st.tuples(st.integers(3, 9), st.integers(3, 9)),
       train=st.booleans(), data=st.data())
def test_random_max_pools_match_eager(kernel, stride, dilation, ceil_mode, relu_first, channels_last, size, train,
                                      data):
    padding = data.draw(st.integers(0, kernel // 2))
    assume(min(size) + 2 * padding - dilation * (kernel - 1) - 1 >= 0)
    model = Pool(kernel, stride, padding, dilation, ceil_mode, relu_first).train(train)
    twin = copy.deepcopy(model)
    x = torch.randint(-3, 4, (2, 5, *size)).float()  # ties: the first maximum must win, as in eager
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    xs = [x.clone().requires_grad_(train), x.clone().requires_grad_(train)]
    torch._dynamo.reset()
    PATHS.clear()
    compiled = resfuse.compile(model, interpret=True)
    with torch.set_grad_enabled(train):
        out, ref = compiled(xs[0]), twin(xs[1])
    assert torch.equal(out, ref)
    assert PATHS[("max_pool2d", "window codes" if train else "", "triton")] == 1
    if train:
        out.square().sum().backward()
        ref.square().sum().backward()
        assert rel(xs[0].grad, xs[1].grad) < 1e-6 and rel(model.scale.grad, twin.scale.grad) < 1e-6
        assert PATHS[("max_pool2d_backward", "window codes", "triton")] == 1


class PoolAndIndices(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        out, idx = nn.functional.max_pool2d(torch.relu(x * self.scale), 3, 2, 1, return_indices=True)
        return out * 2, idx


def test_training_indices_the_user_reads_stay_atens():
    """Window codes only where the backward alone reads the indices: returned to the user, they are ATen's."""
    torch.manual_seed(2)
    model = PoolAndIndices()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 5, 9, 7).contiguous(memory_format=torch.channels_last)
    torch._dynamo.reset()
    PATHS.clear()
    (out, idx), (ref, ref_idx) = resfuse.compile(model, interpret=True)(x), twin(x)
    assert torch.equal(out, ref) and idx.dtype == torch.int64 and torch.equal(idx, ref_idx)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert rel(model.scale.grad, twin.scale.grad) < 1e-6
    assert PATHS[("max_pool2d", "", "triton")] == 1 and PATHS[("max_pool2d_backward", "", "triton")] == 1
    assert not any(detail == "window codes" for _, detail, _ in PATHS)


def test_a_refused_backward_reads_the_window_codes_on_atens_path(monkeypatch):
    """A backward the pass refuses (its layout differs from ATen's: forced here) after its forward wrote window
    codes runs ATen's kernels on indices decoded from them, through our op."""
    from resfuse.passes import pooling

    shape = (2, 5, 9, 7)
    same = pooling._same_layout
    monkeypatch.setattr(pooling, "_same_layout", lambda fake, want: tuple(fake.shape) != shape and same(fake, want))
    model = Pool(3, 2, 1, 1, False, relu_first=True)
    twin = copy.deepcopy(model)
    x = torch.randn(shape)
    torch._dynamo.reset()
    PATHS.clear()
    compiled = resfuse.compile(model, interpret=True)
    out, ref = compiled(x), twin(x)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert torch.equal(out, ref) and rel(model.scale.grad, twin.scale.grad) < 1e-6
    assert PATHS[("max_pool2d", "window codes", "triton")] == 1
    assert PATHS[("max_pool2d_backward", "", "reference")] == 1
    assert "max-pool backward layout differs from ATen's" in reasons(compiled.resfuse_report)


def test_unbatched_pool_is_refused_with_a_reason():
    torch._dynamo.reset()
    compiled = resfuse.compile(nn.MaxPool2d(2), interpret=True)
    x = torch.randn(3, 6, 6)
    assert torch.equal(compiled(x), nn.functional.max_pool2d(x, 2))
    assert "unbatched" in reasons(compiled.resfuse_report)


class SavedThenReused(nn.Module):
    """linear -> gelu, with the pre-activation also read by a reduction whose result the epilogue then wants."""

    def __init__(self, early_read):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.early_read = early_read

    def forward(self, x):
        y = self.fc(x)
        u = y.sum(-1, keepdim=True)  # reads the saved value
        a = nn.functional.gelu(y)
        return a * u if self.early_read else a * 3.0 + u.mean()


@pytest.mark.parametrize("early_read", [True, False])
def test_an_operand_that_reads_the_aux_output_stays_out_of_the_epilogue(early_read):
    torch.manual_seed(5)
    model = SavedThenReused(early_read).eval()
    x = torch.randn(4, 6)
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    assert rel(out, ref) < 1e-6
    ops = [f.ops for f in compiled.resfuse_report.fusions]
    if early_read:  # the mul's other operand is the sum of the saved value: absorbing it would form a cycle
        assert ["bias", "save", "gelu"] in ops
        assert "computed from the saved pre-activation" in reasons(compiled.resfuse_report)
    else:  # a scalar multiply needs no operand: it joins
        assert ["bias", "save", "gelu", "mul"] in ops


class SiluResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return torch.relu(nn.functional.silu(self.conv(x)) + x)


def test_fuse_add_to_output_reopens_an_op_with_an_aux_output():
    """Training: conv + bias -> silu (its input saved: aux) -> + x -> relu. FuseAddToOutput reopens the aux op
    for the add and the relu follows; the saved value still reaches the backward."""
    torch.manual_seed(6)
    model = SiluResidual().train()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 4, 5, 5)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    loss, ref = compiled(xs[0]).square().sum(), twin(xs[1]).square().sum()
    loss.backward()
    ref.backward()
    assert rel(loss, ref) < 1e-6 and rel(xs[0].grad, xs[1].grad) < 1e-5
    for p, q in zip(model.parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) < 1e-5
    forward = [f.ops for f in compiled.resfuse_report.fusions if f.graph == "forward"]
    assert ["bias", "save", "silu", "add", "relu"] in forward, forward


class TimesItsTanh(nn.Module):
    """y * tanh(y): the pre-activation is both the activation's input and the next op's operand. (Not y *
    sigmoid(y), which named_activations now turns into silu(y), one op.)"""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y * torch.tanh(y)


def test_the_saved_value_itself_never_becomes_an_operand_of_its_own_op():
    torch.manual_seed(7)
    model = TimesItsTanh().eval()
    x = torch.randn(2, 3, 5, 5)
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    assert rel(out, ref) < 1e-6
    assert not compiled.resfuse_report.errors
    assert ["bias", "save", "tanh"] in [f.ops for f in compiled.resfuse_report.fusions]
    assert "computed from the saved pre-activation" in reasons(compiled.resfuse_report)


class ConvPool(nn.Module):
    """conv -> batch norm -> activation -> max-pool; optionally the activation is read by a second consumer."""

    def __init__(self, act, second_reader):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 5, 3, padding=1, bias=False), nn.BatchNorm2d(5), act
        self.pool, self.second_reader = nn.MaxPool2d(3, 2, 1), second_reader
        self.bn.running_mean.normal_(), self.bn.running_var.uniform_(0.5, 1.5), self.bn.weight.data.normal_()

    def forward(self, x):
        y = self.act(self.bn(self.conv(x)))
        out = self.pool(y).sum((2, 3))
        return out + y.mean((2, 3)) if self.second_reader else out


@pytest.mark.parametrize("act,monotone", [(nn.ReLU(), True), (nn.ReLU6(), True), (nn.Sigmoid(), True),
                                          (nn.GELU(), False), (nn.SiLU(), False)])
@pytest.mark.parametrize("second_reader", [False, True])
def test_an_inference_pool_takes_its_conv_epilogue_when_monotone_and_sole_reader(act, monotone, second_reader):
    """The pool computes the conv's batch norm and activation (a negative BN scale makes them decreasing in some
    channels) where the activation is monotone and the pool its only reader; else the conv keeps its epilogue."""
    torch.manual_seed(11)
    model = ConvPool(act, second_reader).eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 9, 8).to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True)
    with torch.no_grad():
        assert rel(compiled(x), model(x)) < 1e-5
    patterns = [f.pattern for f in compiled.resfuse_report.fusions]
    if monotone and not second_reader:
        assert len(patterns) == 1 and patterns[0].startswith("max_pool2d_bn_"), patterns
    else:
        assert len(patterns) == 1 and patterns[0].startswith("conv2d_bn_"), patterns
