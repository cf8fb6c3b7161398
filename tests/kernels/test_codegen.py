"""Generated kernel files, the interpreter switch, the config spaces, and the custom-op path into the kernels."""
import pytest
import torch
import triton

from resfuse import kernels
from resfuse.kernels import codegen, conv2d_fprop, matmul
from resfuse.ops import fused


def test_generated_source_is_cached_on_disk_and_in_process():
    sig = "relu(add(mul(acc,c0),full1))"
    k1 = codegen.load(matmul.FAMILY, sig)
    assert codegen.load(matmul.FAMILY, sig) is k1
    files = list((codegen._cache_dir()).glob("gemm_*.py"))
    texts = [f.read_text() for f in files]
    assert any(f"Epilogue: {sig}" in t for t in texts)
    src = codegen.kernel_source(matmul.FAMILY, sig)
    assert "gemm_mainloop(" in src and "split_k_reduce(" in src and "tl.store(out" in src
    # under PDL the kernel waits for its producer before the mainloop's first load
    assert src.index("dependent_launch(PDL)") < src.index("gemm_mainloop(") and "PDL: tl.constexpr" in src
    compile(src, "generated", "exec")


def test_dependent_launch_is_off_where_it_cannot_run():
    """PDL needs a Hopper GPU and compiled kernels: the interpreter's plans take the PDL-free branch, and turning
    the option off rebuilds the plans (it is part of their key)."""
    from resfuse.kernels import launch

    assert launch.pdl_meta(torch.device("cpu")) == {"PDL": False}
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    out = torch.full((5, 3), float("nan"))
    key_on = launch.plan_key("gemm", a, b)
    launch.gemm(a, b, [], "relu(acc)", out)
    assert not next(reversed(launch._PLANS.values())).meta["PDL"]
    torch.testing.assert_close(out, torch.relu(a @ b), rtol=1e-4, atol=1e-4)
    kernels.set_options(pdl=False)
    try:
        assert launch.plan_key("gemm", a, b) != key_on
    finally:
        kernels.set_options(pdl=True)


def test_interpret_switch_is_refused_after_kernels_are_built():
    codegen.load(conv2d_fprop.FAMILY, "acc")
    with pytest.raises(RuntimeError):
        kernels.set_options(interpret=False)
    kernels.set_options(interpret=True)  # same mode: fine


def test_default_configs_are_legal_and_split_deep_small_layers():
    # ResNet-50 layer4 3x3 at batch 1 on an H100: 49 pixels x 512 filters, 4608-deep reduction
    p = conv2d_fprop.ConvProblem(1, 512, 512, 3, 3, 7, 7, 2, 132)
    cfg = conv2d_fprop.default_config(p)
    assert cfg.check(p) and cfg.split_k > 1
    big = matmul.GemmProblem(1, 12288, 768, 3072, 2, 132)
    gcfg = matmul.default_config(big)
    assert gcfg.check(big) and gcfg.split_k == 1
    stem = conv2d_fprop.ConvProblem(32, 3, 64, 7, 7, 112, 112, 2, 132)
    assert conv2d_fprop.default_config(stem).flat
    for m in (1, 17, 300):
        for n in (1, 64, 3000):
            p = matmul.GemmProblem(1, m, n, 40, 4, 1)
            assert matmul.default_config(p).check(p)


def test_custom_ops_run_the_triton_kernels():
    fused.PATHS.clear()
    x = torch.randn(1, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    w = torch.randn(12, 8, 3, 3)
    bias = torch.randn(12, 1, 1)
    out = torch.ops.resfuse.conv2d(x, w, [bias], "relu(add(acc,c0))", [1, 1], [1, 1], [1, 1], "triton")
    ref = torch.relu(torch.nn.functional.conv2d(x, w, None, 1, 1) + bias)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    a, b = torch.randn(2, 9, 20), torch.randn(2, 20, 11)
    out = torch.ops.resfuse.gemm(a, b, [], "tanh(acc)", [2, 9, 11], "triton")
    torch.testing.assert_close(out, torch.tanh(a @ b), rtol=1e-4, atol=1e-4)
    assert {path for (_, _, path) in fused.PATHS} == {"triton"}
    assert triton.__version__
