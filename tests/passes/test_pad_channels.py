"""passes/pad_channels.py end to end under the interpreter: a 3-channel fp16 stem's conv reads its image and
weight padded to 4 channels, in the forward and weight-gradient graphs, and in inference runs as resfuse::image_conv
(padded where that cannot), and the numbers stay those of the float64 model; and each case the pass leaves alone is
reported with its reason."""
import copy
import importlib

import pytest
import torch
import torch.nn as nn

import resfuse
from resfuse.ops.fused import PATHS

pass_module = importlib.import_module("resfuse.passes.pad_channels")  # the package's name is the pass function


@pytest.fixture
def any_size(monkeypatch):
    """Small images under the interpreter: the pass's size threshold is a GPU launch-cost matter."""
    monkeypatch.setattr(pass_module, "MIN_PIXELS", 0)


class Stem(nn.Module):
    """A ResNet stem under autocast's dtypes: the fp32 image cast to fp16 for the conv, the batch norm in fp32."""

    def __init__(self, dtype=torch.float16):
        super().__init__()
        self.conv, self.bn, self.dtype = nn.Conv2d(3, 8, 7, 2, 3, bias=False).to(dtype), nn.BatchNorm2d(8), dtype

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x.to(self.dtype)).to(self.bn.weight.dtype))).square().mean((2, 3))


def _step(model, x, **config):
    model = copy.deepcopy(model)
    compiled = resfuse.compile(model, interpret=x.device.type == "cpu", **config) if config else model
    loss = compiled(x).sum()
    loss.backward()
    return loss.detach(), model.conv.weight.grad, getattr(compiled, "resfuse_report", None)


def _image(n=2, h=19, w=21, layout=torch.channels_last):
    return torch.randn(n, 3, h, w).contiguous(memory_format=layout)


def _pad_rejections(report):
    return [r.reason for r in report.rejected if "padded to 4" in r.reason]


JOINT = ("joint graph: 1 conv(s) and their weight gradients read one copy of their 3-channel input padded to 4 "
         "channels, saved padded (convolution)")


def test_training_stem_reads_its_image_padded_and_trains_like_float64(any_size, tmp_path):
    """The joint graph pads the image and weight once: the forward pads, and the backward reads the saved copies."""
    torch.manual_seed(0)
    model, x = Stem().to(memory_format=torch.channels_last), _image()
    PATHS.clear()
    loss, grad, report = _step(model, x, pad_channels=True, debug_dump=str(tmp_path))
    assert PATHS[("pad_channels", "", "triton")] == 2, PATHS  # x and w, once
    assert [r for r in report.rewrites if "3-channel" in r] == [JOINT], report.rewrites
    backward = next(tmp_path.glob("backward-*-pad_channels.txt")).read_text()
    wgrad = next(line for line in backward.splitlines() if "aten.convolution_backward.default(" in line)
    assert "resfuse.pad_channels" not in backward, backward
    assert ", pad_channels_default, pad_channels_default_1, " in wgrad, wgrad  # the saved copies, as placeholders
    assert 'pad_channels_default: "f16[2, 4, 19, 21]"' in backward, backward
    reference = copy.deepcopy(model).double()
    reference.dtype = torch.float64
    loss64, grad64, _ = _step(reference, x.double())
    assert grad.dtype == torch.float16 and grad.shape == (8, 3, 7, 7)
    assert grad.stride() == model.conv.weight.stride()
    assert torch.allclose(loss.double(), loss64, rtol=2e-3)
    assert ((grad.double() - grad64).norm() / grad64.norm()).item() < 2e-3
    off_loss, off_grad, off_report = _step(model, x, pad_channels=False)
    assert not any("3-channel" in r for r in off_report.rewrites)
    assert torch.allclose(loss, off_loss, rtol=1e-3) and torch.allclose(grad, off_grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", ["image_conv", "off", "wide"])
def test_inference_stem_runs_as_an_image_conv_or_reads_its_image_padded(case, any_size, tmp_path):
    """An inference stem conv becomes resfuse::image_conv; with the switch off, or more outputs than the kernel
    holds, it reads its image padded."""
    torch.manual_seed(0)
    channels = 264 if case == "wide" else 8
    model = nn.Sequential(nn.Conv2d(3, channels, 7, 2, 3, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
                          nn.MaxPool2d(3, 2, 1))
    model = model.eval()
    for p in model.parameters():  # a trained batch norm, not the identity
        p.data.uniform_(0.5, 1.5)
    model.half().to(memory_format=torch.channels_last)
    x = _image().half()
    PATHS.clear()
    compiled = resfuse.compile(copy.deepcopy(model), interpret=True, debug_dump=str(tmp_path),
                               image_convs=case != "off")
    with torch.no_grad():
        out = compiled(x)
        ref = copy.deepcopy(model).double()(x.double())
    graph = next(tmp_path.glob("inference-*-pad_channels.txt")).read_text()
    if case == "image_conv":
        assert "aten.convolution" not in graph and "resfuse.image_conv.default(" in graph, graph
        assert PATHS[("image_conv", "", "triton")] == 1, PATHS
        assert compiled.resfuse_report.rewrites[-1] == ("inference graph: 1 conv(s) over a 3-channel image run as "
                                                        "resfuse::image_conv (convolution_default)")
    else:
        conv = next(line for line in graph.splitlines() if "aten.convolution.default(" in line)
        assert "convolution.default(pad_channels_default, pad_channels_default_1," in conv, graph
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("case", ["fp32", "nchw", "small", "input_grad"])
def test_what_stays_unpadded_is_reported(case, monkeypatch):
    torch.manual_seed(0)
    if case != "small":
        monkeypatch.setattr(pass_module, "MIN_PIXELS", 0)
    model = Stem(torch.float32 if case == "fp32" else torch.float16)
    x = _image(layout=torch.contiguous_format if case == "nchw" else torch.channels_last)
    if case != "nchw":
        model = model.to(memory_format=torch.channels_last)
    x.requires_grad_(case == "input_grad")
    _, _, report = _step(model, x, pad_channels=True)
    reasons = _pad_rejections(report)
    expected = {"fp32": "torch.float32 input", "nchw": "not channels_last", "small": "pixels, under",
                "input_grad": "the input's gradient is asked for"}[case]
    assert reasons and all(expected in r for r in reasons), reasons
    padded = [r for r in report.rewrites if "3-channel" in r]
    assert padded == (["forward graph: 1 conv(s) read their 3-channel input padded to 4 channels (convolution)"]
                      if case == "input_grad" else []), report.rewrites


class CastStem(Stem):
    """Autocast's shape of the stem: an fp32 weight and image, each cast to fp16 for the conv."""

    def __init__(self):
        super().__init__(torch.float32)

    def forward(self, x):
        conv = self.conv
        y = nn.functional.conv2d(x.half(), conv.weight.half(), None, conv.stride, conv.padding)
        return torch.relu(self.bn(y.float())).square().mean((2, 3))


def test_joint_graph_pads_from_the_fp32_image_and_weight(any_size, tmp_path):
    """Where the fp16 casts feed only the conv and its weight gradient, the pads read the fp32 tensors and the
    casts are gone; the fp32 weight's gradient matches float64."""
    torch.manual_seed(0)
    model, x = CastStem().to(memory_format=torch.channels_last), _image()
    loss, grad, report = _step(model, x, pad_channels=True, debug_dump=str(tmp_path))
    assert JOINT in report.rewrites, report.rewrites
    forward = next(tmp_path.glob("forward-*-pad_channels.txt")).read_text()
    pads = [line for line in forward.splitlines() if "resfuse.pad_channels.default(" in line]
    assert len(pads) == 2 and all("primals" in line for line in pads), pads  # the fp32 inputs themselves
    casts = [line for line in forward.splitlines() if "_to_copy" in line or "convert_element_type" in line]
    assert not [c for c in casts if "(primals_1" in c or "(primals_2" in c], casts  # the fp16 casts are gone
    reference = copy.deepcopy(model).double()
    loss64 = torch.relu(reference.bn(nn.functional.conv2d(x.double(), reference.conv.weight, None, 2, 3)))
    loss64.square().mean((2, 3)).sum().backward()
    grad64 = reference.conv.weight.grad
    assert grad.dtype == torch.float32 and grad.stride() == model.conv.weight.stride()
    assert ((grad.double() - grad64).norm() / grad64.norm()).item() < 2e-3


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_stem_on_cudnn_trains_alike_padded_or_not():
    """At the real size threshold (24 images of 224x224), on cuDNN: the padded stem's step matches the unpadded."""
    torch.manual_seed(0)
    model, x = Stem().cuda().to(memory_format=torch.channels_last), _image(24, 224, 224).cuda()
    PATHS.clear()
    loss, grad, report = _step(model, x, pad_channels=True)
    assert PATHS[("pad_channels", "", "triton")] == 2, (PATHS, report.rewrites, _pad_rejections(report))
    off_loss, off_grad, _ = _step(model, x, pad_channels=False)
    assert torch.allclose(loss, off_loss, rtol=1e-4)
    assert ((grad.double() - off_grad.double()).norm() / off_grad.double().norm()).item() < 1e-3


def test_a_failing_joint_rewrite_partitions_the_captured_graph(any_size, monkeypatch):
    from resfuse.capture import backend

    def broken(gm, ctx):  # leaves the graph half rewritten (the image zeroed), then fails
        image = next(iter(gm.graph.nodes))
        with gm.graph.inserting_after(image):
            zeroed = gm.graph.call_function(torch.ops.aten.mul.Tensor, (image, 0.0))
        image.replace_all_uses_with(zeroed, delete_user_cb=lambda user: user is not zeroed)
        raise RuntimeError("boom")

    monkeypatch.setattr(backend, "pad_channels_joint", broken)
    torch.manual_seed(0)
    model, x = Stem().to(memory_format=torch.channels_last), _image()
    loss, grad, report = _step(model, x, pad_channels=True)
    assert report.errors == ["joint graph: rewrite failed, partitioning it as captured: RuntimeError: boom"]
    off_loss, off_grad, _ = _step(model, x, pad_channels=False)
    assert torch.allclose(loss, off_loss, rtol=1e-3) and torch.allclose(grad, off_grad, rtol=1e-2, atol=1e-2)


def test_an_inference_stem_neither_path_takes_is_reported_with_both_reasons(any_size):
    model = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
    model = model.eval().to(memory_format=torch.channels_last)
    compiled = resfuse.compile(model, interpret=True)
    with torch.no_grad():
        compiled(_image())
    reasons = _pad_rejections(compiled.resfuse_report)
    assert reasons == ["3-channel input not padded to 4 for cuDNN: torch.float32 input (measured for fp16 only) "
                       "(nor an image conv: an fp16/bf16 conv, of inputs in its dtype or fp32: got torch.float32 and "
                       "torch.float32 for torch.float32)"], reasons


def test_image_conv_stays_on_the_gpus_it_was_measured_on(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    why = pass_module._unmeasured(torch.device("cuda", 0))
    assert why is not None and "(8, 0)" in why and "Hopper" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert pass_module._unmeasured(torch.device("cuda", 0)) is None
    assert pass_module._unmeasured(torch.device("cpu")) is None  # the interpreter: the tests' path


class CastPoolStem(nn.Module):
    """Autocast's shape of an inference stem: the fp32 image and weight cast to fp16 for the conv, then relu and
    the max-pool (which takes the relu: the conv is left bare)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 7, 2, 3, bias=False)

    def forward(self, x):
        y = nn.functional.conv2d(x.half(), self.conv.weight.half(), None, 2, 3)
        return nn.functional.max_pool2d(torch.relu(y), 3, 2, 1)


def test_an_autocast_stem_conv_reads_the_fp32_image_and_weight(tmp_path):
    """image_conv reads the fp32 tensors the casts read and casts them as it pads: the casts are gone."""
    torch.manual_seed(0)
    model, x = CastPoolStem().eval().to(memory_format=torch.channels_last), _image()
    PATHS.clear()
    compiled = resfuse.compile(copy.deepcopy(model), interpret=True, debug_dump=str(tmp_path))
    with torch.no_grad():
        out = compiled(x)
        ref = nn.functional.max_pool2d(torch.relu(nn.functional.conv2d(
            x.half().double(), model.conv.weight.half().double(), None, 2, 3)), 3, 2, 1)
    graph = next(tmp_path.glob("inference-*-pad_channels.txt")).read_text()
    call = next(line for line in graph.splitlines() if "resfuse.image_conv.default(" in line)
    assert "image_conv.default(arg0_1, arg1_1, [2, 2], [3, 3], torch.float16, 'triton')" in call, graph
    assert "_to_copy" not in graph and "convert_element_type" not in graph, graph
    assert PATHS[("image_conv", "", "triton")] == 1, PATHS
    assert out.dtype == torch.float16
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
