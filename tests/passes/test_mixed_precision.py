"""Mixed precision: an fp16/bf16 GEMM or conv whose output is added to an fp32 tensor (autocast's residual
adds) absorbs the add and stores fp32, under the IR's float32 marker; batch norm and dgrad refuse it."""
import torch

from resfuse import kernels
from resfuse.ops import PATHS  # noqa: F401  (registers the ops)

from .helpers import rel, run


def linear_residual(a, w, b, r):
    return torch.ops.aten.addmm(b, a, w.t()) + r  # bf16 + fp32 -> fp32


def conv_residual(x, w, r):
    return torch.relu(torch.ops.aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1) + r)


def test_gemm_absorbs_a_promoting_add_and_stores_fp32():
    a, w, b = torch.randn(6, 8).bfloat16(), torch.randn(5, 8).bfloat16(), torch.randn(5).bfloat16()
    r = torch.randn(6, 5)
    gm, report = run(linear_residual, a, w, b, r)
    (f,) = report.fusions
    assert f.signature.startswith("float32(") and f.ops[-1] == "to_fp32" and "add" in f.ops
    out = gm(a, w, b, r)
    assert out.dtype == torch.float32
    ref = torch.addmm(b.double(), a.double(), w.double().t()) + r.double()
    assert rel(out, ref) < 1e-2  # bf16 inputs


def test_conv_absorbs_a_promoting_add_then_relu():
    x, w = torch.randn(2, 3, 5, 5).bfloat16(), torch.randn(4, 3, 3, 3).bfloat16()
    r = torch.randn(2, 4, 5, 5)
    gm, report = run(conv_residual, x, w, r)
    (f,) = report.fusions
    assert f.ops == ["add", "relu", "to_fp32"], f.ops
    out = gm(x, w, r)
    ref = torch.relu(torch.nn.functional.conv2d(x.double(), w.double(), padding=1) + r.double())
    assert out.dtype == torch.float32 and rel(out, ref) < 1e-2


def test_gemm_kernel_stores_fp32_from_bf16_inputs_under_the_interpreter():
    kernels.set_options(interpret=True)
    a, b = torch.randn(37, 24).bfloat16(), torch.randn(24, 19).bfloat16()
    r = torch.randn(37, 19)
    out = torch.full((37, 19), float("nan"))
    kernels.gemm(a, b, [r], "float32(add(acc,full0))", out)
    ref = a.double() @ b.double() + r.double()
    assert not out.isnan().any() and rel(out, ref) < 1e-2


def grad_of_linear_input(g, w, other):
    # autocast backward: the bf16 data gradient is converted to fp32 before the skip-gradient add
    return torch.ops.aten._to_copy(torch.ops.aten.mm(g, w), dtype=torch.float32) + other


def test_gemm_absorbs_its_fp32_copy_and_the_add_after_it():
    g, w, other = torch.randn(6, 5).bfloat16(), torch.randn(5, 8).bfloat16(), torch.randn(6, 8)
    gm, report = run(grad_of_linear_input, g, w, other)
    (f,) = report.fusions
    assert f.ops == ["add", "to_fp32"] and "_to_copy" in f.sources[1]
    ref = (g.double() @ w.double()).bfloat16().double() + other.double()  # eager rounds the mm to bf16 first
    assert gm(g, w, other).dtype == torch.float32 and rel(gm(g, w, other), ref) < 1e-3


def bn_train_residual(x, w, b, rm, rv, r):
    y = torch.ops.aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5)[0]
    return y + r  # bf16 + fp32 -> fp32


def test_training_batch_norm_refuses_a_promoting_add_and_says_why():
    from resfuse.config import Config
    from resfuse.passes import PassContext, run_passes
    from resfuse.passes.report import Report
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(2, 3, 4, 4).bfloat16()
    p = [torch.rand(3) + 0.5 for _ in range(4)]
    gm = make_fx(bn_train_residual, tracing_mode="fake")(x, *p, torch.randn(2, 3, 4, 4))
    report = Report()
    run_passes(gm, PassContext(Config(providers=("aten",)), "forward", report))
    assert report.fusions == []
    assert any("mixed-precision add" in r.reason and "batch_norm" in r.reason for r in report.rejected)
