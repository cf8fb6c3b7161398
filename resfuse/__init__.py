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


def compile(model: torch.nn.Module, *, dynamic: bool | None = None, **config) -> torch.nn.Module:
    """Compile `model` with resfuse. The module's `.resfuse_report` fills in as graphs are captured.

    `dynamic` is torch.compile's: None (default) captures the first shapes statically and, when a dim changes,
    recaptures once with it symbolic (a batch dim stays fused); False captures every shape on its own."""
    from .capture.backend import make_backend

    cfg = Config.from_env(**config)
    report = Report()
    compiled = torch.compile(model, backend=make_backend(cfg, report), dynamic=dynamic)
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
