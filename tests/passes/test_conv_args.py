"""A conv's stride, padding and dilation in each form nn.Conv2d takes them ("valid", "same", an int, a pair)
fuses and computes eager's function: ATen gives one value for all dims in some forms (padding=[0] for "valid"),
which once failed the whole graph's passes (HF transformers' EfficientNet ran unfused)."""
import copy

import pytest
import torch
import torch.nn as nn

import resfuse

from .helpers import against_float64, rel

FORMS = [dict(padding="valid"), dict(padding="same"), dict(padding="same", dilation=2), dict(padding=1),
         dict(padding=(1, 0)), dict(stride=2, padding=(0, 1)), dict(stride=(2, 1), padding="valid")]


class Net(nn.Module):
    def __init__(self, **conv):
        super().__init__()
        self.conv = nn.Conv2d(5, 6, 3, bias=False, **conv)
        self.bn = nn.BatchNorm2d(6)
        self.pw = nn.Conv2d(6, 6, 1, padding="valid")

    def forward(self, x, r):
        return torch.relu(self.pw(torch.relu(self.bn(self.conv(x)))) + r)


def inputs(net, requires_grad=False):
    x = torch.randn(2, 5, 9, 7, requires_grad=requires_grad)
    with torch.no_grad():
        r = torch.randn_like(net.bn(net.conv(x)))  # the residual: the conv's output shape for this form
    return x, r


@pytest.mark.parametrize("conv", FORMS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_every_form_of_a_convs_arguments_fuses_and_matches_eager(conv):
    torch.manual_seed(len(str(conv)))
    net = Net(**conv).eval()
    net.bn.running_mean.normal_()
    net.bn.running_var.uniform_(0.5, 1.5)
    x, r = inputs(net)
    out, ref, report = against_float64(net, x, r)
    assert report.errors == []
    assert sorted(f.ops for f in report.fusions) == [["bias", "add", "relu"], ["bn", "relu"]]
    assert {f.ran for f in report.fusions} == {"triton"}
    assert rel(out, ref) < 1e-5


@pytest.mark.parametrize("conv", [FORMS[0], FORMS[5]], ids=["valid", "stride2"])
def test_a_training_step_with_every_form_matches_eager(conv):
    torch.manual_seed(3)
    net = Net(**conv).train()
    twin = copy.deepcopy(net)
    x, r = inputs(net, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    compiled = resfuse.compile(net, interpret=True)
    compiled(x, r).square().sum().backward()
    twin(x2, r).square().sum().backward()
    assert compiled.resfuse_report.errors == []
    assert rel(x.grad, x2.grad) < 1e-4
    for (name, p), q in zip(net.named_parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) < 1e-4, name
