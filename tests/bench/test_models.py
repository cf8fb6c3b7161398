"""models.load on tiny inputs: HF configs with random weights, user factories, clear errors."""
import importlib.util
import textwrap

import pytest
import torch

from resfuse.bench import models


def test_hf_resnet50_small_image_channels_last():
    model, (x,) = models.load("hf-resnet50", 2, torch.float32, "cpu", image_size=32)
    assert not model.training
    assert x.shape == (2, 3, 32, 32) and x.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert model(x).shape == (2, 1000)


def test_hf_bert_base_short_seq():
    model, (ids,) = models.load("hf-bert-base", 2, torch.float32, "cpu", seq=8)
    assert ids.shape == (2, 8) and ids.dtype == torch.int64
    with torch.no_grad():
        assert model(ids).shape == (2, 8, 768)
    assert models.is_text("hf-bert-base")


def test_weights_are_deterministic():
    a, _ = models.load("hf-resnet50", 1, torch.float32, "cpu", image_size=32)
    b, _ = models.load("hf-resnet50", 1, torch.float32, "cpu", image_size=32)
    for pa, pb in zip([*a.parameters(), *a.buffers()], [*b.parameters(), *b.buffers()]):
        assert torch.equal(pa, pb)


def test_calibrate_sets_running_statistics_to_the_batches_average():
    torch.manual_seed(1)
    conv, norm = torch.nn.Conv2d(3, 5, 3), torch.nn.BatchNorm2d(5, momentum=0.3)
    model, weight = torch.nn.Sequential(conv, norm, torch.nn.ReLU()), conv.weight.detach().clone()
    batches = [torch.randn(4, 3, 7, 6) * 3 + 1 for _ in range(3)]
    models.calibrate(model, batches)
    with torch.no_grad():
        acts = [conv(x).double() for x in batches]
    mean = torch.stack([a.mean((0, 2, 3)) for a in acts]).mean(0)
    var = torch.stack([a.var((0, 2, 3), unbiased=True) for a in acts]).mean(0)
    torch.testing.assert_close(norm.running_mean.double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.running_var.double(), var, rtol=1e-5, atol=1e-6)
    assert norm.momentum == 0.3 and not model.training and torch.equal(conv.weight, weight)


def test_only_the_models_that_collapse_get_calibrated_batch_norms(monkeypatch):
    """HF ResNet-50's logits at 32 px: std 3.6 with the default statistics (mean 0, variance 1; 24 at 224 px),
    1.4 calibrated. It keeps the default ones; a model named in COLLAPSES is calibrated."""
    def norms(model):
        return [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]

    model, _ = models.load("hf-resnet50", 2, torch.float32, "cpu", image_size=32)
    assert all(torch.equal(m.running_var, torch.ones_like(m.running_var)) for m in norms(model))
    monkeypatch.setattr(models, "COLLAPSES", ("hf-resnet50",))
    model, (x,) = models.load("hf-resnet50", 2, torch.float32, "cpu", image_size=32)
    assert norms(model) and all(int(m.num_batches_tracked) == 2 for m in norms(model))
    assert not any(torch.equal(m.running_var, torch.ones_like(m.running_var)) for m in norms(model))
    with torch.no_grad():
        assert model(x).std() < 2


def test_default_resnet50_resolves_by_what_is_installed():
    expected = "torchvision:resnet50" if importlib.util.find_spec("torchvision") else "hf-resnet50"
    assert models.resolve("resnet50") == expected


def test_unknown_name_lists_valid_names():
    with pytest.raises(models.UnknownModel, match="hf-bert-base.*file.py:factory"):
        models.load("resnet5O", 1, torch.float32, "cpu")


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed here")
def test_missing_timm_says_so():
    with pytest.raises(models.MissingPackage, match="needs the timm package"):
        models.load("convnext_tiny", 1, torch.float32, "cpu")


FACTORY = textwrap.dedent("""
    import torch
    from torch import nn

    def with_inputs(batch):
        return nn.Linear(4, 3), torch.randn(batch, 4)

    def bare():
        return nn.Conv2d(3, 5, 1)
""")


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(FACTORY)
    return path


def test_factory_with_inputs_gets_batch(factory_file):
    model, (x,) = models.load(f"{factory_file}:with_inputs", 3, torch.float64, "cpu")
    assert x.shape == (3, 4) and x.dtype == torch.float64
    assert model.weight.dtype == torch.float64
    assert models.resolve(f"{factory_file}:with_inputs").startswith("file:")


def test_bare_factory_gets_an_image_batch(factory_file):
    model, (x,) = models.load(f"{factory_file}:bare", 2, torch.float32, "cpu", image_size=16)
    assert x.shape == (2, 3, 16, 16)
    assert model(x).shape == (2, 5, 16, 16)


def test_factory_missing_function(factory_file):
    with pytest.raises(AttributeError, match="no callable 'nope'"):
        models.load(f"{factory_file}:nope", 1, torch.float32, "cpu")
