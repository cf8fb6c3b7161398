"""The torch.compile backend "resfuse" (registered through the torch_dynamo_backends entry point).

Entry point: `resfuse_backend(gm, example_inputs, **options)`. Dynamo hands us a torch-level graph;
aot_autograd lowers it to ATen graphs and calls `compile_graph` on each: the inference graph in eval / no-grad
mode, or the forward and backward graphs in training. `compile_graph` is the whole pipeline on one screen. Each
compiled graph runs under its compile's `Settings` (kernel and tuning options, module state the ops read).
"""
from __future__ import annotations

import copy
import functools
import operator
import warnings

import torch
import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition

from .. import kernels
from ..config import Config
from ..ops import lower_to_impls
from ..passes import PassContext, run_passes
from ..passes.attention_mask import contiguous_attention_masks, drop_all_true_masks
from ..passes.liveness import peak_bytes
from ..passes.merge_linears import merge_linears
from ..passes.pad_channels import pad_channels_joint
from ..passes.report import Report
from ..tuning.progress import PROGRESS
from . import cuda_graphs, inductor
from .constants import budget_bytes, hoist_constants

# Graph kinds the passes rewrite: all of them (aot_autograd's inference graph, or training's forward and backward).
REWRITTEN = ("inference", "forward", "backward")


def compile_graph(gm: fx.GraphModule, example_inputs, *, config: Config, graph: str, report: Report,
                  run_graph: bool = True, graphed: dict | None = None):
    """capture (done by aot_autograd) -> passes -> rewritten graph -> built: its remainder compiled by Inductor, or
    run eagerly with the fused ops lowered to their Python implementations; the fused ops pick their kernels
    (tuning on first call) -> optionally CUDA-graphed.

    With run_graph=False (explain) the report is made but the captured ATen graph runs instead. `graphed` is
    shared by one forward and its backward (whether the forward replays as a CUDA graph).
    """
    if graph not in REWRITTEN:
        report.graphs.append(graph)
        return gm
    original = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # the passes rewrite gm in place
    before = peak_bytes(gm)
    try:
        tune_now = run_graph and kernels.triton_installed() and inductor.wanted(config.remainder, example_inputs)
        gm = run_passes(gm, PassContext(config, graph, report, tune_now))
        report.peak_bytes[graph] = (before, peak_bytes(gm))
        if tune_now:
            compile_ahead(gm, graph, report)
    except Exception as e:  # never crash the user's model: fall back to the captured graph, and say why
        report.errors.append(f"{graph} graph: passes failed, running it unfused: {type(e).__name__}: {e}")
        warnings.warn(f"resfuse: {report.errors[-1]}")
        return original
    if not run_graph:
        return original
    constants = hoisted_constants(gm, example_inputs, config, graph, report)
    if constants:
        example_inputs = constants.example_inputs
    graphed_here = cuda_graphs.wanted(config.cuda_graphs, graph, example_inputs)
    if graph == "forward" and config.cuda_graphs is None and cuda_graphs.on_cuda(example_inputs):
        note = ("training graphs run without CUDA graphs by default, and autograd was recording here (a training "
                "step, or a model called with grad enabled): each fused op costs about 0.1 ms of host time a call, "
                "so small batches are launch-bound. cuda_graphs=True replays them; for inference, call the model "
                "under torch.no_grad() or torch.inference_mode()")
        if note not in report.notes:
            report.notes.append(note)
    why_not = cuda_graphs.refusal(gm, graph) if graphed_here else None  # before lowering: reads op schemas
    built = build(gm, example_inputs, config, graph, report)
    if graphed_here:
        if why_not:
            report.notes.append(f"{graph} graph runs without CUDA graphs: {why_not}")
        built = cuda_graphs.wrap(built, gm, example_inputs, graph, why_not, graphed if graphed is not None else {},
                                   report)
    return constants.wrap(built) if constants else built


def hoisted_constants(gm: fx.GraphModule, example_inputs, config: Config, graph: str, report: Report):
    """An inference graph's values computed from parameters alone, taken out of it (capture/constants.py): gm
    then reads them as inputs after its own. Only an optimisation: on failure, a note and gm as it was."""
    if graph != "inference" or not config.hoist_constants:
        return None
    kept, said = copy.deepcopy(gm.graph), len(report.rewrites)
    try:
        return hoist_constants(gm, example_inputs, cuda_graphs.static_inputs(gm, graph), report,
                               budget_bytes(example_inputs))
    except Exception as e:  # noqa: BLE001  the graph computes them itself, as without the switch
        gm.graph = kept
        gm.recompile()
        del report.rewrites[said:]
        report.notes.append(f"{graph} graph: parameter-only values not hoisted: {type(e).__name__}: {str(e)[:200]}")
        return None


def compile_ahead(gm: fx.GraphModule, graph: str, report: Report) -> None:
    """Queue the Triton kernels and cuDNN engine configs that the graph's first run will tune on the compile
    workers (tuning/precompile.py), so they build while the tuner measures the ops before them. Only a head start:
    on failure, a note."""
    from ..tuning import precompile

    try:
        precompile.ahead(gm)
    except Exception as e:  # noqa: BLE001  the tuner compiles them itself, as without workers
        report.notes.append(f"{graph} graph: kernels not compiled ahead: {type(e).__name__}: {str(e)[:200]}")


def build(gm: fx.GraphModule, example_inputs, config: Config, graph: str, report: Report):
    """The rewritten graph made callable (boxed): the remainder compiled by Inductor where Config.remainder asks
    for it, else run eagerly, each fused op calling its Python implementation directly."""
    if inductor.wanted(config.remainder, example_inputs):
        try:
            from torch._inductor import config as inductor_config

            with inductor_config.patch(combo_kernels=config.combo_kernels and graph != "inference"):
                compiled = inductor.compile_remainder(gm, example_inputs, graph)
        except Exception as e:  # Inductor could not take it: the eager remainder is always there
            report.notes.append(f"{graph} graph: Inductor refused the remainder, running it eagerly: "
                                f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
            warnings.warn(f"resfuse: {report.notes[-1]}")
        else:
            rest = sum(n.op == "call_function" and "resfuse" not in n.meta and n.target is not operator.getitem
                       for n in gm.graph.nodes)
            report.rewrites.append(f"{graph} graph: the {rest} op(s) no fusion absorbed compiled by Inductor")
            return closing_progress(compiled, fused_ops(gm))
    return boxed(track_progress(lower_to_impls(gm)))


def boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """aot_autograd's boxed calling convention: the graph takes its inputs as one list and empties it, so each
    input is freed after its last use. In a backward graph the inputs are the activations the forward saved;
    called unboxed they would all stay alive until the backward ends, raising training's peak memory."""
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


def fused_ops(gm: fx.GraphModule) -> int:
    return sum("resfuse" in n.meta for n in gm.graph.nodes)


def track_progress(gm: fx.GraphModule) -> fx.GraphModule:
    """Tell the tuning progress bar how many fused ops this graph has, and let the graph's end close it: by
    the end of its first call every fused op has chosen its implementation."""
    if fused := fused_ops(gm):
        PROGRESS.expect(fused)
        with gm.graph.inserting_before(gm.graph.output_node()):
            gm.graph.call_function(PROGRESS.graph_ran, ())
        gm.recompile()
    return gm


def closing_progress(fn, fused: int):
    """track_progress for a compiled (boxed) callable: the call after it closes the bar."""
    if not fused:
        return fn
    PROGRESS.expect(fused)

    def run(inputs: list):
        out = fn(inputs)
        PROGRESS.graph_ran()
        return out

    run._boxed_call = True
    return run


def partition(joint: fx.GraphModule, joint_inputs, *, config: Config, report: Report, **options):
    """aot_autograd's default partition of a training step's joint graph, after the rewrites that must see the
    forward and the backward together (what the forward saves for the backward)."""
    original = fx.GraphModule(joint, copy.deepcopy(joint.graph))
    try:
        joint = pad_channels_joint(joint, PassContext(config, "joint", report))
    except Exception as e:  # never crash the user's model: partition the graph as it was captured, and say why
        report.errors.append(f"joint graph: rewrite failed, partitioning it as captured: {type(e).__name__}: {e}")
        warnings.warn(f"resfuse: {report.errors[-1]}")
        joint = original
    return default_partition(joint, joint_inputs, **options)


class Settings:
    """A compile's settings that live in module state, which each fused op reads as it runs: the kernels' options
    (kernels.set_options) and the tuner's (tuning.choose.configure). Made current when the compile starts, and again
    at each call of the graphs it compiled: otherwise a model compiled later with other settings (tuning="none",
    pdl=False, another cache_dir) would change what this one's ops run from then on."""
    current = None

    def __init__(self, config: Config):
        self.config = config
        self.enter(new_compile=True)

    def enter(self, new_compile: bool = False) -> None:
        if Settings.current is self and not new_compile:
            return
        c = self.config
        kernels.set_options(cache_dir=c.cache_dir, split_k=c.split_k, pdl=c.pdl, prefetch=c.prefetch_weights,
                            tma_store=c.tma_store, compile_workers=c.compile_workers)
        # The interpreter is a process-wide Triton mode: a config can turn it on, never off again. Without it,
        # fused ops on CPU tensors take the reference path (PassContext.provider_for).
        if c.interpret:
            kernels.set_options(interpret=True)
        if kernels.triton_installed():
            from ..tuning.choose import configure

            configure(c.tuning, c.cache_dir, c.tuning_budget_s, c.retune, new_compile=new_compile,
                      providers=c.providers)
        Settings.current = self

    def wrap(self, fn):
        """fn (a compiled graph, boxed) entering these settings first; the captured graph that a failed compile
        falls back to (ATen ops alone, unboxed) as it is."""
        if not getattr(fn, "_boxed_call", False):
            return fn

        def run(inputs: list):
            self.enter()
            return fn(inputs)

        run._boxed_call = True
        return run


def make_backend(config: Config, report: Report, run_graph: bool = True):
    settings = Settings(config)

    def step(gm: fx.GraphModule, example_inputs, graph: str, graphed: dict):
        return settings.wrap(compile_graph(gm, example_inputs, config=config, graph=graph, report=report,
                                           run_graph=run_graph, graphed=graphed))

    def backend(gm: fx.GraphModule, example_inputs):
        settings.enter()  # the passes tune some ops as they compile
        # before aot_autograd: its trace picks the attention kernel, and differentiates the merged linears
        gm = contiguous_attention_masks(drop_all_true_masks(gm, report), report)
        if config.merge_linears:
            gm = merge_linears(gm, report)
        # per dynamo graph, so that a backward knows whether its own forward replays as a CUDA graph
        step_here = functools.partial(step, graphed={})
        lower = aot_autograd(fw_compiler=functools.partial(step_here, graph="forward"),
                             bw_compiler=functools.partial(step_here, graph="backward"),
                             inference_compiler=functools.partial(step_here, graph="inference"),
                             partition_fn=functools.partial(partition, config=config, report=report),
                             keep_inference_input_mutations=True)
        return lower(gm, example_inputs)

    return backend


def resfuse_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """torch.compile(model, backend="resfuse", options={...}); the report is kept on resfuse.last_report."""
    from .. import _set_last_report

    report = Report()
    _set_last_report(report)
    return make_backend(Config.from_env(**options), report)(gm, example_inputs)
