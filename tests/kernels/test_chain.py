"""The chain kernel (kernels/chain.py) under the interpreter: two 1x1 convs in one kernel, random epilogues on
both, pixel counts that are not multiples of the row block, every operand kind and layout; and its refusals."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from resfuse import epilogue as epi
from resfuse.kernels import chain

from .epilogues import assert_close, make_operand, reference, trees


def _nhwc(shape, dtype):
    return torch.randn(shape).to(dtype).contiguous(memory_format=torch.channels_last)


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype).contiguous(memory_format=torch.channels_last)


def _operands(data, roles, out_shape, dtype):
    layouts = data.draw(st.lists(st.integers(0, 2), min_size=len(roles), max_size=len(roles)))
    return [make_operand(role, kind, out_shape, 1, dtype, lay) for (kind, role), lay in zip(roles, layouts)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), n=st.integers(1, 2),
       h=st.integers(1, 5), w=st.integers(1, 6), k1=st.sampled_from([16, 32]), n1=st.sampled_from([16, 32, 48]),
       n2=st.sampled_from([16, 32]), block_m=st.sampled_from([16, 32]), persistent=st.sampled_from([1, 2]))
def test_chain_matches_two_convs(data, dtype, n, h, w, k1, n1, n2, block_m, persistent):
    tree1, roles1 = data.draw(trees())
    tree2, roles2 = data.draw(trees())
    x = _nhwc([n, k1, h, w], dtype)
    w1 = (torch.randn(n1, k1, 1, 1) / k1 ** 0.5).to(dtype)
    w2 = (torch.randn(n2, n1, 1, 1) / n1 ** 0.5).to(dtype)
    ops1 = _operands(data, roles1, [n, n1, h, w], dtype)
    ops2 = _operands(data, roles2, [n, n2, h, w], dtype)
    y, z = _poisoned([n, n1, h, w], dtype), _poisoned([n, n2, h, w], dtype)
    cfg = chain.ChainConfig(block_m=block_m, block_n1=16, persistent=persistent)
    chain.conv2d_chain(x, w1, ops1, str(tree1), w2, ops2, str(tree2), y, z, cfg)

    y_ref = reference(F.conv2d(x.double(), w1.double()), tree1, ops1, 1)
    assert_close(epi.rows3(y, y.shape, 1), y_ref, dtype)
    # the kernel multiplies y as it stores it into z, as the second conv would read it: z is checked against
    # the second conv of the y just checked (a fp64 y rounded apart from the kernel's by one ulp moves z by more
    # than bf16's tolerance)
    z_ref = reference(F.conv2d(y.double(), w2.double()), tree2, ops2, 1)
    assert_close(epi.rows3(z, z.shape, 1), z_ref, dtype)


def test_chain_resnet_pair_default_config():
    """A ResNet bottleneck's tail (batch norm, residual, relu) and the next head (batch norm, relu), with the
    heuristic config: a channels_last residual read through a descriptor, 19 pixel rows past a 64-row block."""
    dtype = torch.float16
    x = _nhwc([1, 32, 9, 9], dtype)
    w1 = (torch.randn(128, 32, 1, 1) / 32 ** 0.5).to(dtype)
    w2 = (torch.randn(32, 128, 1, 1) / 128 ** 0.5).to(dtype)
    bn1 = [torch.randn(128), torch.rand(128) + 0.5, torch.randn(128), torch.randn(128)]
    bn2 = [torch.randn(32), torch.rand(32) + 0.5, torch.randn(32), torch.randn(32)]
    res = _nhwc([1, 128, 9, 9], dtype)
    sig1, sig2 = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))", "relu(bn[#1e-05](acc,c0,c1,c2,c3))"
    y, z = _poisoned([1, 128, 9, 9], dtype), _poisoned([1, 32, 9, 9], dtype)
    chain.conv2d_chain(x, w1, [*bn1, res], sig1, w2, bn2, sig2, y, z)

    def bn(t, m, v, g, b):
        return (t - m[:, None, None]) / torch.sqrt(v[:, None, None] + 1e-5) * g[:, None, None] + b[:, None, None]
    y_ref = torch.relu(bn(F.conv2d(x.double(), w1.double()), *map(torch.Tensor.double, bn1)) + res.double())
    z_ref = torch.relu(bn(F.conv2d(y.double(), w2.double()), *map(torch.Tensor.double, bn2)))
    assert_close(y.double(), y_ref, dtype)
    assert_close(z.double(), z_ref, dtype)


@pytest.mark.parametrize("case, reason", [
    ("fp32", "fp16/bf16"), ("k1=24", "powers of two"), ("n2=512", "powers of two"), ("n1=40", "multiple of 16"),
    ("3x3", "two 1x1 convs"), ("grouped", "grouped"), ("contiguous", "channels_last"),
    ("wide", "no config"),  # ResNeXt-50's layer-2 pair
])
def test_chain_refusals(case, reason):
    k1, n1, n2 = {"k1=24": (24, 64, 32), "n2=512": (32, 64, 512), "n1=40": (32, 40, 32),
                  "wide": (256, 512, 256)}.get(case, (32, 64, 32))
    dtype = torch.float32 if case == "fp32" else torch.float16
    x = torch.randn(2, k1, 4, 4, dtype=dtype)
    if case != "contiguous":
        x = x.contiguous(memory_format=torch.channels_last)
    w1 = torch.randn(n1, k1 // 2 if case == "grouped" else k1, *((3, 3) if case == "3x3" else (1, 1)), dtype=dtype)
    w2 = torch.randn(n2, n1, 1, 1, dtype=dtype)
    assert reason in chain.refusal(x, w1, w2)
    y, z = _poisoned([2, n1, 4, 4], dtype), _poisoned([2, n2, 4, 4], dtype)
    with pytest.raises(NotImplementedError, match=reason):
        chain.conv2d_chain(x, w1, [], "acc", w2, [], "acc", y, z)


def test_chain_config_check():
    p = chain.ChainProblem(m=1000, k1=64, n1=256, n2=64, dtype_bytes=2, sms=132)
    assert chain.default_config(p).check(p)
    assert not chain.ChainConfig(block_n1=96).check(p)  # 256 is not walked in chunks of 96
    assert not chain.ChainConfig(block_m=256, block_n1=256).check(p)  # registers
    odd = chain.ChainProblem(1000, 16, 48, 16, 2, 1)
    assert chain.default_config(odd).block_n1 == 16 and chain.default_config(odd).check(odd)


def test_chain_default_config_fits_or_the_pair_is_refused():
    """The heuristic config (tuning "none") must pass `check`, or the pair is refused. ResNet-50's layer-1 pair
    keeps the two-stage default it was tuned on; its layer-2 pair and the pair between them take one stage (two
    stages do not fit their shared memory: the test below). ResNeXt-50's layer-2 pair (256 > 512 > 256) and
    ResNet-50's layer-3 pair (256 > 1024 > 256) fit no config, so neither is ever compiled (the old default was
    launched for them unchecked)."""
    import itertools

    for k1, n1, n2, stages in ((64, 256, 64, 2), (64, 256, 128, 1), (128, 512, 128, 1)):
        p = chain.ChainProblem(m=6272, k1=k1, n1=n1, n2=n2, dtype_bytes=2, sms=132)
        assert chain.default_config(p) == chain.ChainConfig(num_stages=stages)
    odd = chain.ChainProblem(m=6272, k1=128, n1=48, n2=128, dtype_bytes=2, sms=132)
    assert chain.default_config(odd) == chain.ChainConfig(block_n1=16)
    for k1, n1, n2 in ((256, 512, 256), (256, 1024, 256)):
        p = chain.ChainProblem(m=6272, k1=k1, n1=n1, n2=n2, dtype_bytes=2, sms=132)
        assert chain.default_config(p) is None
        assert not any(chain.ChainConfig(**dict(zip(chain.SPACE, values))).check(p)
                       for values in itertools.product(*chain.SPACE.values()))


def test_chain_configs_that_pass_check_fit_a_hopper_block(tmp_path):
    """Compiled for sm_90 on this CPU (bench/chain_smem.py, a fresh process with a fake Hopper driver):
    `staged_bytes` is at most what each config takes, and the configs `check` passes fit an H100 block. At two
    stages the layer-1-to-2 pair (64 > 256 > 128) takes 262,744 bytes, which the old unchecked default launched."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    run = subprocess.run([sys.executable, "bench/chain_smem.py", "--pairs", "64>256>64,64>256>128,128>512>128",
                          "--configs", "128x2,128x1,64x1"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines()[1:] if line.strip()]
    assert len(rows) == 9, run.stdout
    refused = 0
    for pair, bn1, stages, taken in rows:
        k1, n1, n2 = map(int, pair.split(">"))
        p = chain.ChainProblem(m=6272, k1=k1, n1=n1, n2=n2, dtype_bytes=2, sms=132)
        cfg = chain.ChainConfig(block_n1=int(bn1), num_stages=int(stages))
        assert cfg.staged_bytes(p) <= int(taken), (pair, bn1, stages)
        if cfg.check(p):
            assert int(taken) <= chain.SMEM_BYTES, (pair, bn1, stages)
        refused += int(taken) > chain.SMEM_BYTES
    assert refused == 2  # both pairs past layer 1's own, at two stages
