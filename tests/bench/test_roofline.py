"""The roofline floor's arithmetic on layers whose FLOPs and bytes are counted by hand (fp32: 4 bytes)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from resfuse.bench import roofline

F32 = 4


def test_single_conv_flops_and_bytes():
    conv = nn.Conv2d(3, 8, 3, padding=1).eval()
    x = torch.randn(1, 3, 8, 8)
    (layer,) = roofline.trace_layers(conv, (x,))
    assert layer.kind == "compute"
    # 2 FLOPs per MAC; one MAC per output element per (Cin x kh x kw).
    assert layer.flops == 2 * (1 * 8 * 8 * 8) * (3 * 3 * 3)
    # input + weight + bias read once, output written once.
    assert layer.bytes == F32 * (1 * 3 * 8 * 8 + 8 * 3 * 3 * 3 + 8 + 1 * 8 * 8 * 8)


def test_linear_flops_and_bytes():
    lin = nn.Linear(16, 32).eval()
    (layer,) = roofline.trace_layers(lin, (torch.randn(4, 16),))
    assert layer.flops == 2 * 4 * 16 * 32
    assert layer.bytes == F32 * (4 * 16 + 32 * 16 + 32 + 4 * 32)


class ResidualBlock(nn.Module):
    """conv -> bn -> (+ x) -> relu: one fused layer; x is read once although two ops read it."""

    def __init__(self, c=8):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + x)


def test_epilogue_and_residual_add_are_absorbed():
    block = ResidualBlock().eval()
    x = torch.randn(2, 8, 4, 4)
    layers = roofline.trace_layers(block, (x,))
    assert [layer.kind for layer in layers] == ["compute"]
    assert {"convolution", "add", "relu"} <= set(layers[0].ops)
    act = 2 * 8 * 4 * 4
    assert layers[0].bytes == F32 * (act + 8 * 8 + 4 * 8 + act)  # x, weight, 4 BN vectors, output


def test_memory_only_layer_between_anchors():
    model = nn.Sequential(nn.Conv2d(4, 4, 1, bias=False), nn.MaxPool2d(2), nn.Conv2d(4, 4, 1, bias=False))
    layers = roofline.trace_layers(model.eval(), (torch.randn(1, 4, 8, 8),))
    assert [layer.kind for layer in layers] == ["compute", "memory", "compute"]
    pool = layers[1]
    assert pool.flops == 0
    assert pool.bytes == F32 * (4 * 8 * 8 + 4 * 4 * 4)  # reads the conv's output, writes a quarter of it


def test_attention_flops():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))

    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    layers = roofline.trace_layers(Attention(), (q, k, v))
    # Q @ K^T and P @ V: 2 * B * H * Lq * Lk * (D + Dv), whichever CPU kernel runs it.
    assert sum(layer.flops for layer in layers) == 2 * 1 * 2 * 16 * 16 * (8 + 8)


def test_grouped_query_attention_flops():
    """Llama's attention: 8 query heads over 2 key/value heads, each of those serving 4. The traced CPU kernel and
    the GPU's (their formula given the shapes alone, as a CUDA trace would) count the query's heads."""
    q, k, v = torch.randn(1, 8, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)

    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    want = 2 * 1 * 8 * 16 * 16 * (8 + 8)
    assert sum(layer.flops for layer in roofline.trace_layers(Attention(), (q, k, v))) == want
    meta = [t.to("meta") for t in (q, k, v)]
    aten = torch.ops.aten
    for op in (aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention):
        assert roofline._FLOPS[op](*meta, None, False, out_val=(meta[0],)) == want


@pytest.mark.parametrize("flops_per_s, bytes_per_s, bound", [(1e3, 1e12, "compute"), (1e15, 1e3, "memory")])
def test_floor_takes_the_larger_term_per_layer(flops_per_s, bytes_per_s, bound):
    conv = nn.Conv2d(3, 8, 3, padding=1).eval()
    x = torch.randn(1, 3, 8, 8)
    seconds, (layer,) = roofline.floor(conv, (x,), (flops_per_s, bytes_per_s))
    assert layer.bound == bound
    assert seconds == pytest.approx(max(layer.flops / flops_per_s, layer.bytes / bytes_per_s))


def test_floor_sums_layers():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).eval()
    seconds, layers = roofline.floor(model, (torch.randn(4, 16),), (1e9, 1e9))
    assert len(layers) == 2
    assert seconds == pytest.approx(sum(max(l.flops, l.bytes) / 1e9 for l in layers))


def test_measure_ceilings_on_cpu_is_positive():
    flops_per_s, bytes_per_s = roofline.measure_ceilings("cpu", repeats=2)
    assert flops_per_s > 1e6 and bytes_per_s > 1e6


def test_attention_is_one_layer_without_the_score_matrix():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    mask = torch.zeros(16, 16).masked_fill(torch.rand(16, 16) > 0.5, float("-inf")).fill_diagonal_(0)

    class Attention(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # a mask may force the math path

    (layer,) = roofline.trace_layers(Attention(), (q, k, v))
    assert layer.kind == "compute"
    assert layer.bytes == F32 * (4 * 1 * 2 * 16 * 8 + 16 * 16)  # q, k, v, out and the mask: no 16x16 scores


def test_resnet50_groups_into_one_layer_per_conv():
    from resfuse.bench import models

    # meta tensors: shapes only, so the full 224x224 model traces in about a second.
    model, inputs = models.load("hf-resnet50", 2, torch.float16, "meta")
    layers = roofline.trace_layers(model, inputs)
    compute = [layer for layer in layers if layer.kind == "compute"]
    assert len(compute) == 53 + 1  # 53 convolutions (BN, ReLU and residual adds absorbed) and the classifier
    assert {layer.ops[0] for layer in layers if layer.kind == "memory"} == {"max_pool2d_with_indices", "mean"}
    assert sum("add_" in layer.ops or "add" in layer.ops for layer in compute) == 16  # one residual per block
