"""hf-llama cut to its first few decoder layers, for A/Bs that must fit a few minutes of device time (the layers'
shapes are hf-llama's, so the tuning cache serves them):

  python bench/activations_ab.py --model bench/llama_layers.py:model --batch 8 --switch leave_adds_to_inductor
"""
import torch

from resfuse.bench import models

LAYERS = 4


def model(batch: int, seq: int):
    torch.manual_seed(models.SEED)
    net = models.llama(LAYERS)
    return net, (torch.randint(0, net.model.config.vocab_size, (batch, seq)),)
