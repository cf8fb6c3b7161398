"""The shortcut kernel (kernels/shortcut.py) on ResNet-50's four downsampling blocks' shapes, compiled on the GPU
(`TRITON_INTERPRET=0 pytest -m requires_cuda tests/test_shortcut_devices.py`) for each tile shape of its space, in
both forms (two epilogues; the sum, both batch norms folded), and one small block under the interpreter:
relu(bn(conv(y)) + bn(conv(x, stride))) against float64, the residual rounded to fp16 as the unfused path stores
it (the sum form's is not rounded: both are within the tolerance)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from resfuse.kernels import shortcut

from .kernel_devices import DEVICES, skip_unless_available

MAIN, SHORT = "relu(add(bn[#1e-05](acc,c0,c1,c2,c3),full4))", "bn[#1e-05](acc,c0,c1,c2,c3)"
# (mid channels, output channels, x's channels, output pixels a side, stride): layer1..layer4 of ResNet-50
RESNET50 = [(64, 256, 64, 56, 1), (128, 512, 256, 28, 2), (256, 1024, 512, 14, 2), (512, 2048, 1024, 7, 2)]


def _bn(c, device):
    return [torch.randn(c, device=device) * 0.1, torch.rand(c, device=device) + 0.5,
            torch.rand(c, device=device) + 0.5, torch.randn(c, device=device) * 0.1]


def _block(batch, k1, n, k2, side, stride, device):
    cl = torch.channels_last
    y = torch.randn(batch, k1, side, side, device=device).half().contiguous(memory_format=cl)
    x = torch.randn(batch, k2, side * stride, side * stride, device=device).half().contiguous(memory_format=cl)
    w1 = (torch.randn(n, k1, 1, 1, device=device) / k1 ** 0.5).half()
    w2 = (torch.randn(n, k2, 1, 1, device=device) / k2 ** 0.5).half()
    return y, w1, _bn(n, device), x, w2, _bn(n, device)


def _reference(y, w1, bn1, x, w2, bn2, stride):
    def bn(t, m, v, g, b):
        return (t - m[:, None, None]) / torch.sqrt(v[:, None, None] + 1e-5) * g[:, None, None] + b[:, None, None]
    r = bn(F.conv2d(x.double(), w2.double(), stride=stride), *(t.double() for t in bn2)).half().double()
    return torch.relu(bn(F.conv2d(y.double(), w1.double()), *(t.double() for t in bn1)) + r)


@pytest.mark.parametrize("device", DEVICES)
def test_resnet50_downsampling_blocks_match_float64(device):
    skip_unless_available(device)
    from resfuse.ops import shortcut as op

    blocks = RESNET50 if device == "cuda" else [(16, 48, 32, 5, 2)]
    for k1, n, k2, side, stride in blocks:
        y, w1, bn1, x, w2, bn2 = _block(4 if device == "cuda" else 2, k1, n, k2, side, stride, device)
        ref = _reference(y, w1, bn1, x, w2, bn2, stride)
        p = shortcut.ShortcutProblem(y.shape[0] * side * side, k1, k2, n, 2, 132 if device == "cuda" else 1)
        configs = [None, shortcut.ShortcutConfig(32, 32, 32, 8, 4, 2, tma_store=True),
                   shortcut.ShortcutConfig(32, 32, 32, 8, 4, 2, fold=True)]
        if device == "cuda":  # each tile shape of the space once (the tuner checks every candidate it times)
            configs = [None, *(c for c in (shortcut.ShortcutConfig(bm, bn, 64, 8, w, 4, store, fold)
                                           for bm in (64, 128, 256) for bn in (64, 128, 256) for w in (4, 8)
                                           for store in (False, True) for fold in (False, True))
                               if c.check(dataclasses.replace(p, foldable=c.fold)) and (c.num_warps == 4 or c.fold)
                               and (not c.tma_store or c.block_n == 256))]
        call = op.call_of(y, w1, bn1, MAIN, 4, x, w2, bn2, SHORT, [stride, stride])
        for cfg in configs:
            z = torch.full_like(ref, float("nan"), dtype=torch.float16).contiguous(memory_format=torch.channels_last)
            op.run_kernel(call, cfg, z)
            err = (z.double() - ref).abs() / (1 + ref.abs())
            assert not z.isnan().any() and err.max().item() < 5e-3, (k1, n, k2, side, stride, cfg, err.max().item())
