"""Build small ATen graphs with make_fx (fake tensors in node.meta["val"]) and run the passes on them."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from resfuse.config import Config
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
