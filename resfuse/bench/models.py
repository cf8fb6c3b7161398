"""The benchmark's model zoo: a name in, an eval-mode model and its example inputs out.

Entry points: `load(name, batch, dtype, device, channels_last=True, image_size=224, seq=384)`, called by
`resfuse bench` (run.py) and by the CLI's `resfuse explain`; `Autocast(model, dtype)`, a model run under
torch.autocast (bench/ab.py --autocast). This is the first step of a benchmark run;
nothing here knows about resfuse itself.

Names (see `names()`):
- torchvision (weights=None): resnet50, resnet18, resnext50_32x4d, wide_resnet50_2, mobilenet_v3_large,
  efficientnet_b0.
- timm (pretrained=False): convnext_tiny, regnety_040.
- Hugging Face transformers, built from a default config with random weights; nothing is downloaded:
  hf-resnet50 (ResNetConfig), hf-convnext-tiny (ConvNextConfig, whose default is the tiny model),
  hf-bert-base (BertConfig; input_ids [batch, seq]), hf-vit-base (ViTConfig), hf-gpt2 (GPT2Config, GPT-2 small:
  12 layers of 768; input_ids [batch, seq]; its MLP's gelu_new is written out in elementwise ops), hf-llama
  (LlamaConfig at TinyLlama-1.1B's sizes: 22 layers of 2048, a SwiGLU MLP of 5632, 32 heads over 4 key/value
  heads; input_ids [batch, seq]).
- "path/to/file.py:factory": factory() returns a module, or (module, inputs). It may take any of the
  keyword arguments batch, image_size, seq, dtype, device; those it names are passed.

"resnet50" is the default model. It means torchvision's resnet50 when torchvision imports (the model the
field benchmarks, and the one the GPU numbers in design.md were taken on), else HF's ResNet-50 — the same
architecture (bottleneck blocks 3-4-6-3, 25.6 M parameters) — so that the CPU CI machine, which has
transformers but no torchvision, still runs the default. `resolve(name)` says which one a name means;
run.py records it in the JSON so the two are never confused.

Weights are random (seeded), so outputs are meaningless but deterministic; the numerics check compares
each compiled peer against eager on the same weights. Three zoo models get batch-norm running statistics
from two random batches (`calibrate`, `COLLAPSES`): with the default ones (mean 0, variance 1) a random-init fp16
MobileNetV3 or EfficientNet-B0 gave a constant output, and RegNetY one that did not depend on its input, outputs
that cannot tell a right peer from a wrong one. The others keep the default statistics: calibrated, a random-init
ResNet-50 is ill-conditioned (HF's, bs4 at 96 px on the CPU: eager fp16 off fp64 by 4.5e-2, against 5.0e-4 with
the default statistics), and its error column would measure fp16's rounding instead of the compiler. HF models
are wrapped to return one tensor (logits or last_hidden_state) rather than a ModelOutput, so every peer's output
compares the same way.
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

TORCHVISION = ("resnet50", "resnet18", "resnext50_32x4d", "wide_resnet50_2", "mobilenet_v3_large",
               "efficientnet_b0")
TIMM = ("convnext_tiny", "regnety_040")
HF = ("hf-resnet50", "hf-convnext-tiny", "hf-bert-base", "hf-vit-base", "hf-gpt2", "hf-llama")
TEXT_MODELS = ("hf-bert-base", "hf-gpt2", "hf-llama")  # inputs are token ids [batch, seq], not images
SEED = 0
COLLAPSES = ("mobilenet_v3_large", "efficientnet_b0", "regnety_040")  # calibrated batch norms (see above)


class UnknownModel(ValueError):
    """A name that is neither a zoo entry nor a file.py:factory."""


class MissingPackage(RuntimeError):
    """The name is valid but the package that provides it is not installed here."""


def names() -> list[str]:
    return [*TORCHVISION, *TIMM, *HF]


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve(name: str) -> str:
    """The concrete source a name loads from, e.g. "torchvision:resnet50" or "hf-resnet50"."""
    if _is_factory(name):
        return f"file:{name}"
    if name == "resnet50" and not _importable("torchvision"):
        return "hf-resnet50"
    if name in TORCHVISION:
        return f"torchvision:{name}"
    if name in TIMM:
        return f"timm:{name}"
    if name in HF:
        return name
    raise UnknownModel(f"unknown model {name!r}; valid names: {', '.join(names())}, "
                       "or path/to/file.py:factory")


def is_text(name: str) -> bool:
    return resolve(name) in TEXT_MODELS


def load(name: str, batch: int, dtype: torch.dtype, device: str | torch.device, channels_last: bool = True,
         image_size: int = 224, seq: int = 384) -> tuple[nn.Module, tuple]:
    """Build `name` in eval mode on `device` in `dtype`, with example inputs for a batch of `batch`.

    Floating-point inputs are random normal (never zeros: zeros can run faster than real data); token
    ids are random in the vocabulary. channels_last applies to the model and to 4-D inputs.
    """
    source = resolve(name)
    torch.manual_seed(SEED)
    if source.startswith("file:"):
        model, inputs = _from_factory(name, batch=batch, image_size=image_size, seq=seq, dtype=dtype,
                                      device=device)
    else:
        model = _BUILDERS[source.split(":")[0]](source.split(":")[-1])
        if source in TEXT_MODELS:
            inputs = (_token_ids(model, batch, seq),)
        else:
            inputs = (torch.randn(batch, 3, image_size, image_size),)
            if name in COLLAPSES:
                calibrate(model.to(device), [torch.randn(8, 3, image_size, image_size, device=device)
                                             for _ in range(2)])
    model = model.eval().to(device=device, dtype=dtype)
    inputs = tuple(_place(x, dtype, device, channels_last) for x in inputs)
    if channels_last and any(isinstance(x, torch.Tensor) and x.dim() == 4 for x in inputs):
        model = model.to(memory_format=torch.channels_last)
    return model, inputs


def calibrate(model: nn.Module, batches: list[torch.Tensor]) -> None:
    """The batch norms' running statistics set to their average over `batches`, run in train mode (fp32, no
    gradients); every other module and parameter is left as it was. A model without batch norms, or on the meta
    device (no values to average), is not run."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms or not batches or batches[0].is_meta:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches
    model.train()
    with torch.no_grad():
        for x in batches:
            model(x)
    model.eval()
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum


def _place(x, dtype, device, channels_last):
    if not isinstance(x, torch.Tensor):
        return x
    x = x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def _require(module: str, name: str) -> None:
    if not _importable(module):
        raise MissingPackage(f"model {name!r} needs the {module} package, which is not installed here "
                             f"(pip install {module}); the hf-* models need only transformers")


def _torchvision(name: str) -> nn.Module:
    _require("torchvision", name)
    import torchvision.models

    return getattr(torchvision.models, name)(weights=None)


def _timm(name: str) -> nn.Module:
    _require("timm", name)
    import timm

    return timm.create_model(name, pretrained=False)


class _FirstOutput(nn.Module):
    """Return the HF model's main tensor (`field`) so peers compare one tensor, not a ModelOutput."""

    def __init__(self, model: nn.Module, field: str):
        super().__init__()
        self.model, self.field = model, field

    def forward(self, *args):
        return getattr(self.model(*args), self.field)


class Autocast(nn.Module):
    """`model` run under torch.autocast(device_type, dtype): mixed-precision inference of fp32 weights, as
    bench/ab.py --autocast, bench/zoo_smoke.py and tests/test_constants.py compile it."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device_type: str = "cuda"):
        super().__init__()
        self.model, self.dtype, self.device_type = model, dtype, device_type

    def forward(self, *args):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.model(*args)


def _hf(name: str) -> nn.Module:
    _require("transformers", name)
    import transformers as tf

    # Default configs are the base sizes: ResNet-50, ConvNeXt-tiny, BERT-base, ViT-base/16. The
    # classifiers get ImageNet's 1000 labels (the config default is 2) to match torchvision/timm.
    if name == "hf-resnet50":
        return _FirstOutput(tf.ResNetForImageClassification(tf.ResNetConfig(num_labels=1000)), "logits")
    if name == "hf-convnext-tiny":
        return _FirstOutput(tf.ConvNextForImageClassification(tf.ConvNextConfig(num_labels=1000)), "logits")
    if name == "hf-bert-base":
        return _FirstOutput(tf.BertModel(tf.BertConfig()), "last_hidden_state")
    if name == "hf-gpt2":
        return _FirstOutput(tf.GPT2Model(tf.GPT2Config()), "last_hidden_state")
    if name == "hf-llama":
        return llama()
    if name == "hf-vit-base":
        # ViT's default 224 image size fixes its position embeddings; interpolate for other sizes.
        return _ViT(tf.ViTModel(tf.ViTConfig(), add_pooling_layer=False))
    raise AssertionError(name)


def llama(layers: int = 22) -> nn.Module:
    """hf-llama: a random-weight LlamaModel at TinyLlama-1.1B's sizes, its first `layers` decoder layers."""
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                            num_key_value_heads=4, max_position_embeddings=2048)
    return _FirstOutput(tf.LlamaModel(config), "last_hidden_state")


class _ViT(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        size = self.model.config.image_size
        interpolate = pixel_values.shape[-1] != size or pixel_values.shape[-2] != size
        return self.model(pixel_values, interpolate_pos_encoding=interpolate).last_hidden_state


def _token_ids(model: nn.Module, batch: int, seq: int) -> torch.Tensor:
    config = model.model.config
    if seq > config.max_position_embeddings:
        raise ValueError(f"seq {seq} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    return torch.randint(0, config.vocab_size, (batch, seq))


_BUILDERS: dict[str, Callable[[str], nn.Module]] = {
    "torchvision": _torchvision, "timm": _timm, **{n: _hf for n in HF}}


def _is_factory(name: str) -> bool:
    path, sep, attr = name.rpartition(":")
    return bool(sep) and path.endswith(".py") and attr.isidentifier()


def _from_factory(name: str, **available) -> tuple[nn.Module, tuple]:
    path, _, attr = name.rpartition(":")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"model file {path!r} not found (from {name!r})")
    spec = importlib.util.spec_from_file_location(f"resfuse_bench_user_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    # Registered before running it, as `import` would: dynamo (and pickle) look classes up by __module__.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AttributeError(f"{path} has no callable {attr!r}")
    params = inspect.signature(factory).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in available.items() if takes_all or k in params}
    made = factory(**kwargs)
    if isinstance(made, nn.Module):
        # A bare module gets an image batch, the common case for a residual CNN.
        size = available["image_size"]
        return made, (torch.randn(available["batch"], 3, size, size),)
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        model, inputs = made
        return model, inputs if isinstance(inputs, tuple) else (inputs,)
    raise TypeError(f"{name}: factory must return a module or (module, inputs), got {type(made).__name__}")
