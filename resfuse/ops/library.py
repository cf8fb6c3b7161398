"""How the resfuse ops are registered: one torch.library fragment, each op's schema inferred from its Python
implementation's type hints, that implementation run on every device (CompositeExplicitAutograd), and a fake
implementation for tracing.

Entry point: `Op(name, impl)`, used as torch.library.custom_op is (`op.register_fake` decorates the fake). Not
custom_op itself: its Python autograd and aliasing-check layers cost 28 against 11 us per call of a conv2d-like
signature on the CI CPU (more on the GPU machines' hosts), and Inductor's code calls our ops through the
dispatcher on every run that is not a CUDA-graph replay. No autograd kernel is needed: the ops appear only in
graphs that aot_autograd has already differentiated, where no tensor requires grad.
"""
from __future__ import annotations

import torch

LIB = torch.library.Library("resfuse", "DEF")


class Op:
    def __init__(self, name: str, impl):
        self.name = name
        LIB.define(name + torch.library.infer_schema(impl, mutates_args=()))
        LIB.impl(name, impl, "CompositeExplicitAutograd")

    def register_fake(self, fake):
        torch.library.register_fake(f"resfuse::{self.name}", fake, lib=LIB)
        return fake

    def __call__(self, *args, **kwargs):
        return getattr(torch.ops.resfuse, self.name)(*args, **kwargs)
