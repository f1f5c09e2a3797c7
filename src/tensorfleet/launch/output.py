"""How the launcher shows what its tasks print and what it does to them.

:class:`~tensorfleet.launch.local_cluster.LocalCluster` reports four kinds of events to an
:class:`Output`: a task started, a task printed a line, a task exited, and a message of the
launcher itself (reports, warnings). Lines arrive from one reader thread per task, so every
implementation is thread-safe.

- :class:`PlainOutput` writes ``[worker:1] text`` lines, one ``write`` + ``flush`` per line,
  and the launcher's own messages as ``[launcher] ...`` lines on a second stream (stderr by
  default). It is what CI logs and pipes get.
- :class:`LiveOutput` prints the same prefixed log through rich and keeps a live panel under
  it with one row per task (name, state, latest line) and, once the chief prints progress
  lines (:class:`~tensorfleet.session.progress_hook.ProgressHook`), a progress bar to the
  last step with the global step, steps/s and the time left. It is what a terminal gets.
  In a log (:class:`PlainOutput`) the chief's own progress line is that one plain line per
  interval.
- :class:`Output` itself shows nothing (benchmarks, tests that only read recent lines).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from tensorfleet.session.progress_report import (
    ProgressReport,
    format_duration,
    parse_progress_line,
)

#: Prefix of the launcher's own lines, so they stand out from the tasks' lines.
LAUNCHER_PREFIX = "[launcher]"

#: Message levels, from least to most alarming.
LEVELS = ("info", "warning", "error")

_LEVEL_STYLES = {"info": "dim", "warning": "yellow", "error": "bold red"}
_WORKER_STYLES = ("green", "magenta", "blue", "yellow", "bright_green", "bright_magenta")


def task_style(task: str) -> str:
    """A stable colour for a task's prefix: ps tasks cyan, workers cycling through a palette."""
    job, _, index = task.partition(":")
    if job == "ps":
        return "cyan"
    try:
        return _WORKER_STYLES[int(index) % len(_WORKER_STYLES)]
    except ValueError:
        return "white"


def _prefix_message(text: str, level: str) -> list[str]:
    """Lines of a launcher message, each prefixed so that ``grep '\\[launcher\\]'`` finds all."""
    head = f"{LAUNCHER_PREFIX} " if level == "info" else f"{LAUNCHER_PREFIX} {level}: "
    lines = text.splitlines() or [""]
    return [head + lines[0]] + [f"{LAUNCHER_PREFIX} {line}" for line in lines[1:]]


class Output:
    """Receives the launcher's events and shows nothing; subclasses decide how to show them.

    It is a context manager so that a view which owns the terminal (:class:`LiveOutput`) can
    be started before the tasks and restored after them.
    """

    def __enter__(self) -> Output:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop owning the terminal (if it did); later events are still shown."""

    def task_started(self, task: str, pid: int) -> None:
        """``task`` (e.g. ``"worker:1"``) runs as process ``pid``."""

    def line(self, task: str, text: str) -> None:
        """``task`` printed ``text`` (one line, without its line ending)."""

    def task_exited(self, task: str, status: str, ok: bool) -> None:
        """``task`` ended; ``status`` says how (``"exited 3"``); ``ok`` is False for a failure."""

    def message(self, text: str, level: str = "info") -> None:
        """A message of the launcher itself; ``level`` is one of :data:`LEVELS`."""


class PlainOutput(Output):
    """Prefixed lines on plain streams: ``[ps:0] text`` for tasks, ``[launcher] ...`` for us.

    Task lines go to ``stream`` (stdout by default), the launcher's messages to
    ``message_stream`` (stderr by default; pass the same stream to keep one log). stdout is
    flushed before each message so that the two stay in order when both go to one file. A
    closed stream (``tensorfleet launch ... | head``) silences the output instead of breaking
    the supervision of the tasks.
    """

    def __init__(self, stream: TextIO | None = None, message_stream: TextIO | None = None):
        self.stream = sys.stdout if stream is None else stream
        self.message_stream = sys.stderr if message_stream is None else message_stream
        self._lock = threading.Lock()

    def line(self, task: str, text: str) -> None:
        self._write(self.stream, f"[{task}] {text}\n")

    def task_exited(self, task: str, status: str, ok: bool) -> None:
        # A failure is followed by the launcher's report; saying it twice would be noise.
        if ok:
            self.message(f"{task} ended: {status}")

    def message(self, text: str, level: str = "info") -> None:
        self._write(self.message_stream, "".join(f"{ln}\n" for ln in _prefix_message(text, level)))

    def _write(self, stream: TextIO, data: str) -> None:
        with self._lock:
            try:
                if stream is not self.stream:
                    self.stream.flush()
                stream.write(data)
                stream.flush()
            except (OSError, ValueError):
                # Broken pipe or closed stream: the reader is gone; keep supervising quietly.
                pass


@dataclass
class _TaskView:
    """What the live panel shows of one task."""

    pid: int
    started: float = field(default_factory=time.monotonic)
    latest: str = ""
    status: str | None = None
    ok: bool = True


class LiveOutput(Output):
    """The prefixed log scrolling above a live panel with one row per task (a terminal view).

    Use it as a context manager: entering starts the panel (rich ``Live``), leaving stops it
    and leaves its last state on screen. Child output may carry ANSI colours; they are kept
    in the log and dropped from the panel's one-line summary.
    """

    def __init__(self, console: Console | None = None, refresh_per_second: float = 4.0):
        self.console = Console() if console is None else console
        self.refresh_per_second = refresh_per_second
        self._tasks: dict[str, _TaskView] = {}
        self._live: Live | None = None
        #: The latest progress line of the chief, parsed (None before the first).
        self.progress: ProgressReport | None = None

    def __enter__(self) -> LiveOutput:
        self._live = Live(
            console=self.console,
            get_renderable=self._render,
            refresh_per_second=self.refresh_per_second,
            transient=False,
        )
        self._live.start()
        return self

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def task_started(self, task: str, pid: int) -> None:
        self._tasks[task] = _TaskView(pid=pid)

    def line(self, task: str, text: str) -> None:
        body = Text.from_ansi(text)
        report = parse_progress_line(body.plain)
        if report is not None:
            self.progress = report
        view = self._tasks.get(task)
        if view is not None:
            view.latest = body.plain
        prefix = Text(f"[{task}] ", style=task_style(task))
        self.console.print(Text.assemble(prefix, body), soft_wrap=True, highlight=False)

    def task_exited(self, task: str, status: str, ok: bool) -> None:
        view = self._tasks.get(task)
        if view is not None:
            view.status, view.ok = status, ok

    def message(self, text: str, level: str = "info") -> None:
        style = _LEVEL_STYLES.get(level, "")
        for line in _prefix_message(text, level):
            self.console.print(Text(line, style=style), soft_wrap=True, highlight=False)

    def _render(self) -> Group:
        """The panel: a rule, then ``name  state  latest line`` for every task."""
        table = Table.grid(expand=True, padding=(0, 1))
        table.add_column(no_wrap=True)
        table.add_column(no_wrap=True, min_width=14)
        table.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
        now = time.monotonic()
        for task, view in list(self._tasks.items()):
            if view.status is None:
                state = Text(f"running {now - view.started:.0f}s", style="bold")
            else:
                state = Text(view.status, style="green" if view.ok else "bold red")
            table.add_row(Text(task, style=task_style(task)), state, Text(view.latest, style="dim"))
        parts: list[RenderableType] = [Rule("tensorfleet launch", style="dim")]
        if self.progress is not None:
            parts.append(_progress_row(self.progress))
        parts.append(table)
        return Group(*parts)


def _progress_row(report: ProgressReport) -> Table:
    """``global step 1200/3000 [bar] 40%  41.2 steps/s  0:00:44 left`` as a rich row."""
    row = Table.grid(expand=True, padding=(0, 1))
    row.add_column(no_wrap=True)
    row.add_column(ratio=1)
    row.add_column(no_wrap=True)
    rate = f"{report.steps_per_s:.1f} steps/s"
    fraction = report.fraction
    if fraction is None or report.last_step is None:
        row.add_row(
            Text(f"global step {report.step}", style="bold"),
            Text("(no last step)", style="dim"),
            Text(rate),
        )
        return row
    eta = "?" if report.eta_s is None else format_duration(report.eta_s)
    row.add_row(
        Text(f"global step {report.step}/{report.last_step}", style="bold"),
        ProgressBar(total=float(report.last_step), completed=float(report.step)),
        Text(f"{fraction * 100:.0f}%  {rate}  {eta} left"),
    )
    return row
