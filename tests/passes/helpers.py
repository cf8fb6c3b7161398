"""Build small ATen graphs with make_fx (fake tensors in node.meta["val"]) and run the passes on them; small
bottleneck networks compiled whole under the interpreter (`net`, `compare`)."""
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import resfuse
from resfuse.config import Config
from resfuse.ops import PATHS
from resfuse.passes import PassContext, run_passes
from resfuse.passes.report import Report


def run(fn, *inputs, **config):
    """(rewritten graph module, report) for fn traced on inputs."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    report = Report()
    gm = run_passes(gm, PassContext(Config.from_env(**{"providers": ("aten",), **config}), "inference", report))
    return gm, report


def reasons(report) -> str:
    return " | ".join(r.reason for r in report.rejected)


def conv_w(cin, cout, k=3):
    return torch.randn(cout, cin, k, k) / (cin * k * k) ** 0.5


def bn_params(c):
    return (torch.rand(c) + 0.5, torch.randn(c), torch.randn(c) * 0.1, torch.rand(c) + 0.5)  # w, b, mean, var


def bn(y, w, b, mean, var):
    return torch.ops.aten._native_batch_norm_legit_no_training(y, w, b, mean, var, 0.1, 1e-5)[0]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck (v1.5: the stride in the 3x3 conv), written out: CI has no torchvision."""

    def __init__(self, cin, mid, stride=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, mid * 4, 1, bias=False), nn.BatchNorm2d(mid * 4)
        self.down = None
        if stride != 1 or cin != mid * 4:
            self.down = nn.Sequential(nn.Conv2d(cin, mid * 4, 1, stride, bias=False), nn.BatchNorm2d(mid * 4))

    def forward(self, x):
        skip = x if self.down is None else self.down(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return torch.relu(self.bn3(self.conv3(out)) + skip)


def stage(cin, mid, blocks, stride):
    layers = [Bottleneck(cin, mid, stride)] + [Bottleneck(mid * 4, mid) for _ in range(blocks - 1)]
    for m in nn.Sequential(*layers).modules():
        if isinstance(m, nn.BatchNorm2d):  # statistics a trained net could have, not the identity
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return layers


def net(*stages):
    """A stem conv, then stages of bottlenecks, each (input channels, mid channels, blocks, first block's stride)."""
    return nn.Sequential(nn.Conv2d(3, stages[0][0], 3, padding=1), *[b for s in stages for b in stage(*s)])


def compare(model, x, **config):
    """(resfuse's output, the float64 eager output, the report) of the model in fp16 channels_last, compiled with
    `config` under the interpreter."""
    model = model.eval().half().to(memory_format=torch.channels_last)
    x = x.half().contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = model.double()(x.double())
        model.half()
        torch._dynamo.reset()
        PATHS.clear()
        compiled = resfuse.compile(model, **{"interpret": True, **config})
        out = compiled(x)
    return out, ref, compiled.resfuse_report


def against_float64(model, *inputs, **config):
    """(resfuse's output, the float64 eager output, the report) of `model` compiled under the interpreter in its own
    dtype, with `config`; the model is float64 afterwards."""
    torch._dynamo.reset()
    compiled = resfuse.compile(model, interpret=True, **config)
    with torch.no_grad():
        out = compiled(*inputs)
        ref = model.double()(*(x.double() for x in inputs))
    return out, ref, compiled.resfuse_report


def unloadable(calls: list):
    """A plan's `launch` failing as a config too large for the GPU's shared memory does (Triton raises as the kernel
    loads, before anything runs), each call counted in `calls`."""
    from triton.runtime.errors import OutOfResources

    def launch(*args, **kwargs):
        calls.append(1)
        raise OutOfResources(262744, 232448, "shared memory")
    return launch


def half_calls(model, shape, calls: int = 2, **config):
    """`model` in fp16 channels_last, compiled under the interpreter with `config` (PATHS cleared first), called
    `calls` times on fresh inputs of `shape`, each output within 5e-3 of the float64 model's: its report."""
    model = model.eval().half().to(memory_format=torch.channels_last)
    torch._dynamo.reset()
    PATHS.clear()
    compiled = resfuse.compile(model, interpret=True, **config)
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(shape).half().contiguous(memory_format=torch.channels_last)
            assert rel(compiled(x), model.double()(x.double())) < 5e-3
            model.half()
    return compiled.resfuse_report
