"""resfuse: residual-block epilogue fusion for PyTorch, as a torch.compile backend.

Public API:
  torch.compile(model, backend="resfuse")    the backend (entry point torch_dynamo_backends)
  resfuse.compile(model, **config)            the same, with options from Config; returns the compiled module
  resfuse.explain(model, *inputs, **config)   the fusion report, without running any fused kernel
  resfuse.Config                              the options, each with a one-line doc
Pipeline, one folder per stage: capture/ -> passes/ -> ops/ -> kernels/ (ARCHITECTURE.md).
"""
from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers the resfuse:: custom ops)
from .config import Config
from .passes.report import Report

__all__ = ["Config", "Report", "compile", "explain", "last_report"]
_LAST: list[Report] = []


def _set_last_report(report: Report) -> None:
    _LAST[:] = [report]


def last_report() -> Report | None:
    """The report of the most recent torch.compile(..., backend="resfuse") capture."""
    return _LAST[0] if _LAST else None


def compile(model: torch.nn.Module, *, dynamic: bool | None = None, guard_filter_fn=None,
            **config) -> torch.nn.Module:
    """Compile `model` with resfuse. The module's `.resfuse_report` fills in as graphs are captured.

    `dynamic` is torch.compile's: None (default) captures the first shapes statically and, when a dim changes,
    recaptures once with it symbolic (a batch dim stays fused); False captures every shape on its own.
    `guard_filter_fn` is torch.compile's too (an `options` entry): which of Dynamo's guards each call checks on the
    host before it runs the graph. At batch 1 that check is a large part of a call; for example
    torch.compiler.skip_guard_on_all_nn_modules_unsafe drops the guards on the model's modules and parameters
    (HF ResNet-50: 481 -> 53 us a call on a 2-core CPU host, 251 -> 87 on an H100 machine's, bench/guard_time.py).
    That is host time, and latency only where the host sets the pace: ResNet-50 bs1 under CUDA graphs on an H100
    was no faster with it where the GPU did, and 0.587 -> 0.315 ms on a slower host. Unsafe, as its name says: a
    change to the model after compiling (model.train(), a replaced layer) is then not seen, and the stale graph
    runs."""
    from .capture.backend import make_backend

    cfg = Config.from_env(**config)
    report = Report()
    options = {"guard_filter_fn": guard_filter_fn} if guard_filter_fn is not None else None
    compiled = torch.compile(model, backend=make_backend(cfg, report), dynamic=dynamic, options=options)
    compiled.resfuse_report = report
    compiled.resfuse_config = cfg
    return compiled


def explain(model: torch.nn.Module, *example_inputs, **config) -> Report:
    """Capture `model` on `example_inputs` and return the fusion report. No fused kernel runs: the captured
    ATen graph runs once (eager ops) to drive the capture."""
    from .capture.backend import make_backend

    cfg = Config.from_env(**config)
    report = Report()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=make_backend(cfg, report, run_graph=False), dynamic=False)
    with torch.no_grad():
        compiled(*example_inputs)
    torch._dynamo.reset()
    return report
