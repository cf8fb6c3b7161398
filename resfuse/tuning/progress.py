"""Tuning progress: a rich progress bar over a compile's fused ops, with one line per op tuned.

Entry point: `PROGRESS`, the process's one bar. The backend calls `expect(n)` with each rewritten graph's
number of fused ops, and the graph itself calls `graph_ran()` at its end (by the end of its first call every
op has chosen; later calls find nothing to do);
`choose()` calls `measuring()` before it tunes an op, which shows the bar, and `op_done(line)` the first time
it sees each problem: a line for a measured op ("tuned
conv2d 32x64x56x56 relu(...): aten+epilogue 13.0 us, 16.67x over aten"), none for a cache hit. Ops of the same
problem share one choice, so the bar may stop short of its total: `graph_ran` closes it.
"""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class TuningProgress:
    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.bar: Progress | None = None
        self.task = None
        self.total = self.done = 0

    def expect(self, n: int) -> None:
        self.total += n

    def measuring(self) -> None:
        """An op is about to be measured: show the bar. A warm start (every op a cache hit) never starts one;
        starting and stopping rich's live display cost it over a second (bench/warm_start.py profile)."""
        if self.bar is None and self.total:
            self.bar = Progress(TextColumn("resfuse: tuning fused ops"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task("tune", total=self.total, completed=min(self.done, self.total))

    def op_done(self, line: str | None = None) -> None:
        if line:
            self.console.print(line, highlight=False, soft_wrap=True)
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, completed=min(self.done, self.total))

    def graph_ran(self) -> None:
        """Called at the end of every run of a graph with fused ops (a flag test after the first)."""
        if self.total or self.bar is not None:
            self.finish()

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        self.bar, self.task, self.total, self.done = None, None, 0, 0


PROGRESS = TuningProgress()
