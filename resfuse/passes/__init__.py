"""Graph -> graph passes over an ATen FX graph, in order. Entry point: `run_passes(gm, ctx)`.

Order matters: two normalising passes come first (a conv's list arguments written out per dim, an activation
written out in elementwise ops replaced by its one op); then the permutes sink, so that the elementwise ops after a
permuted conv/GEMM follow it;
the epilogue pass runs next so that FuseAddToOutput finds fused producers to absorb adds
into (and then lets the trailing activation follow the add in); the report reads the final graph.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.fx as fx

from ..config import Config
from .activations import named_activations
from .add_to_output import add_to_output
from .bn_backward import batch_norm_backward
from .chain import chain_convs
from .conv_args import full_conv_args
from .conv_stats import conv_stats
from .glu import glu_linears
from .match_epilogue import match_epilogue
from .pad_channels import pad_channels
from .permutes import sink_permutes
from .pooling import max_pool
from .report import Report
from .shortcut_bn import shortcut_bn
from .shortcut_conv import shortcut_convs


@dataclasses.dataclass
class PassContext:
    config: Config
    graph: str  # "inference", "forward" or "backward"
    report: Report
    tune_now: bool = False  # may a pass tune an op at capture (the graph will run, its remainder on Inductor)

    def provider_for(self, anchor: fx.Node) -> str:
        """Who runs this fused op: Triton kernels on CUDA (or on CPU under the interpreter), else ATen."""
        first = self.config.providers[0] if self.config.providers else "aten"
        device = anchor.meta["val"].device
        return first if device.type == "cuda" or self.config.interpret else "aten"

    def reject(self, node: fx.Node, reason: str) -> None:
        self.report.reject(self.graph, node, reason)


def _epilogue(gm, ctx):
    return match_epilogue(gm, ctx) if ctx.config.fuse_epilogue else gm


def _collect(gm, ctx):
    return ctx.report.collect(gm, ctx.graph)


PASSES = [
    ("full_conv_args", full_conv_args),  # first: every pass after it reads a conv's stride, padding, ... per dim
    ("named_activations", named_activations),  # before the fusions: an activation written out becomes one op
    ("sink_permutes", sink_permutes),  # before the fusions: brings a permuted GEMM's consumers next to it
    ("glu_linears", glu_linears),  # before match_epilogue, which would take the gated MLP's GEMM alone
    ("match_epilogue", _epilogue),
    ("add_to_output", add_to_output),  # after match_epilogue: it extends the fused ops that pass made
    ("shortcut_bn", shortcut_bn),  # after add_to_output: folds the batch norm whose output that pass absorbed
    ("conv_stats", conv_stats),  # after the batch-norm fusions: hands their conv's sums to the final batch norms
    ("bn_backward", batch_norm_backward),  # after the fusions: its grad_out is their dgrad's output
    ("max_pool", max_pool),  # after the fusions, which never absorb a pool: its input is their output
    ("shortcut_convs", shortcut_convs),  # after the fusions, before chain_convs, which would take its main conv
    ("chain_convs", chain_convs),  # after the fusions: pairs their fused 1x1 convs, epilogues complete
    ("pad_channels", pad_channels),  # after every fusion: pads the image of a conv left to cuDNN, no fused op's
    ("report", _collect),  # last: reads the final graph
]


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    dump = Path(ctx.config.debug_dump) if ctx.config.debug_dump else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{ctx.graph}-00-captured.txt").write_text(gm.print_readable(print_output=False))
    for i, (name, run) in enumerate(PASSES, 1):
        gm = run(gm, ctx)
        if dump:
            (dump / f"{ctx.graph}-{i:02d}-{name}.txt").write_text(gm.print_readable(print_output=False))
    return gm
