"""Shared by the cudnn provider's tests (test_cudnn_provider.py, test_fold_bn.py): the relative error they judge
by, and the conv + batch norm cases."""
import torch

from resfuse.ops.fused import Output

BN_RELU = "relu(bn[#1e-05](acc,c0,c1,c2,c3))"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bn_vectors(k, device="cpu", dtype=torch.float32):
    return [torch.randn(k, device=device).to(dtype), (torch.rand(k, device=device) + 0.1).to(dtype),
            torch.randn(k, device=device).to(dtype), torch.randn(k, device=device).to(dtype)]


def bn_conv_case(shape, cout, k, stride, sig, dtype=torch.float16):
    cl, dev = torch.channels_last, "cuda"
    x = torch.randn(shape, device=dev).to(dtype).contiguous(memory_format=cl)
    w = (torch.randn(cout, shape[1], k, k, device=dev) / (shape[1] * k * k) ** 0.5).to(dtype)
    w = w.contiguous(memory_format=cl)
    params = ([stride] * 2, [k // 2] * 2, [1, 1])
    oh = (shape[2] + 2 * (k // 2) - k) // stride + 1
    ow = (shape[3] + 2 * (k // 2) - k) // stride + 1
    out_shape = [shape[0], cout, oh, ow]
    ops = bn_vectors(cout, dev, dtype)
    if "full4" in sig:
        ops.append(torch.randn(out_shape, device=dev).to(dtype).contiguous(memory_format=cl))
    return x, w, ops, params, Output.of(out_shape, dtype, torch.device(dev), cl)
