"""The cudnn provider's refusals on a machine without it (CI): every reason is specific, nothing crashes.

Its graphs themselves need a GPU and the nvidia-cudnn-frontend extra: bench/cudnn_check.py checks their
numerics against the unfused reference and times them there."""
import torch

from resfuse import epilogue as epi
from resfuse.ops.fused import Output
from resfuse.providers import candidates, cudnn
from resfuse.tuning.choose import Call


def _conv_call(sig="relu(add(acc,c0))", device="cpu"):
    x, w = torch.randn(1, 4, 5, 5, device=device), torch.randn(6, 4, 3, 3, device=device)
    return Call("conv2d", (x, w), [torch.randn(6, device=device)], sig, ([1, 1], [1, 1], [1, 1]),
                Output.of([1, 6, 5, 5], torch.float32, torch.device(device)))


def test_refusals_say_why():
    gemm = Call("gemm", (torch.randn(3, 4), torch.randn(4, 5)), [], "relu(acc)", ([3, 5],),
                Output.of([3, 5], torch.float32, torch.device("cpu")))
    assert "conv2d forward only" in cudnn.refusal(gemm)
    assert "CUDA device" in cudnn.refusal(_conv_call())
    if cudnn._cudnn() is None:
        assert cudnn.refusal(_conv_call()) is not None
    assert "no cuDNN pointwise form" in cudnn._unsupported(epi.parse("hardswish(acc)"))
    assert cudnn._unsupported(epi.parse("relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))")) is None


def test_no_cudnn_candidates_on_cpu():
    assert not any(c.provider == "cudnn" for c in candidates(_conv_call(), "fast"))
