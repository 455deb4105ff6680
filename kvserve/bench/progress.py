"""A live progress bar (rich) fed by the load generator, one tick per finished request."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvserve.bench.records import RequestRecord


@dataclass(slots=True)
class LiveProgress:
    total: int | None  # requests; None for a --duration run
    console: Console
    num_failed: int = 0
    _progress: Progress | None = field(default=None, init=False)
    _task: int | None = field(default=None, init=False)

    def __enter__(self) -> LiveProgress:
        self._progress = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(),
                                  console=self.console, transient=True)
        self._progress.start()
        self._task = self._progress.add_task("requests", total=self.total, failed=0)
        return self

    def __exit__(self, *exc) -> None:
        assert self._progress is not None
        self._progress.stop()

    def record_done(self, record: RequestRecord) -> None:
        assert self._progress is not None and self._task is not None
        self.num_failed += not record.ok
        self._progress.update(self._task, advance=1, failed=self.num_failed)
