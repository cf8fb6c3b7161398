"""The image conv (kernels/conv2d_image.py) compiled on the GPU (`TRITON_INTERPRET=0 pytest -m requires_cuda
tests/test_image_conv_devices.py`) on ResNet-50's stem (7x7 stride 2, 3 > 64 channels, a 224 x 224 image) and other
stems' shapes (3x3 stride 2, 4x4 stride 4), in fp16 and bf16, and one small stem under the interpreter, against the
float64 conv; the output poisoned with NaN first."""
import pytest
import torch
import torch.nn.functional as F

from resfuse.kernels import conv2d_image

from .kernel_devices import DEVICES, skip_unless_available

# (batch, image side, output channels, filter side, stride, padding)
STEMS = [(1, 224, 64, 7, 2, 3), (3, 224, 64, 7, 2, 3), (2, 224, 32, 3, 2, 1), (2, 224, 96, 4, 4, 0),
         (2, 31, 24, 7, 2, 3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stems_match_float64(device, dtype):
    skip_unless_available(device)
    for n, side, k, r, stride, pad in STEMS if device == "cuda" else STEMS[-1:]:
        x = torch.randn(n, 3, side, side, device=device).to(dtype).contiguous(memory_format=torch.channels_last)
        w = (torch.randn(k, 3, r, r, device=device) / (3 * r * r) ** 0.5).to(dtype)
        ref = F.conv2d(x.double(), w.double(), None, stride, pad)
        out = torch.full(ref.shape, float("nan"), dtype=dtype, device=device)
        out = out.contiguous(memory_format=torch.channels_last)
        conv2d_image.image_conv(x, w, (stride, stride), (pad, pad), out)
        err = (out.double() - ref).abs() / (1 + ref.abs())
        assert not out.isnan().any() and err.max().item() < 2 * torch.finfo(dtype).eps, (n, side, k, r, err.max())
