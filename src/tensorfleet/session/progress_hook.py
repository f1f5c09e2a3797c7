"""The chief reports how far training is: global step, a bar to the last step, steps/s, ETA.

:class:`ProgressHook` runs on the chief only. Every ``every_n_secs`` seconds (and once at
the end) it prints one progress line (:mod:`tensorfleet.session.progress_report`)::

    [progress] global step 1200/3000 [########............] 40% 41.2 steps/s, 0:00:44 left

The line is plain ASCII (no escape codes, no carriage returns), so a log keeps one line per
interval; under ``tensorfleet launch`` the launcher parses it and shows a progress bar in
its live view on a terminal. Run alone on a terminal (no launcher), the hook draws rich's
progress bar instead (``display="auto"``).

The last step comes from ``last_step=``, else from the session's :class:`StopAtStep`. With
neither the line has no bar and no time left: ``global step 1200 (no last step) 41.2
steps/s``. Steps per second are global steps (every worker's) over a sliding window of the
latest intervals, so a pause (a ps restarting) shows at once and passes.

Under ``tensorfleet launch`` a :class:`~tensorfleet.session.training_session.TrainingSession`
adds a ``ProgressHook`` to the chief by default (:func:`default_progress_hook`), so the
launcher's live view shows the run's progress whatever the script: the launcher exists to
watch a cluster, and the line costs one print per interval. A script that passes its own
``ProgressHook`` keeps it (no second one); ``TrainingSession(progress_secs=None)`` turns
the default off. Outside the launcher nothing is added: a script run by hand, under Slurm
or on Kubernetes prints what its hooks print.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from tensorfleet import environment
from tensorfleet.errors import ConfigError
from tensorfleet.session.hooks import Hook, StepResult, StopAtStep
from tensorfleet.session.progress_report import ProgressReport, format_progress_line

if TYPE_CHECKING:
    from tensorfleet.session.training_session import TrainingSession

#: Intervals over which steps per second are averaged.
RATE_WINDOW = 6


def _print_line(line: str) -> None:
    print(line, flush=True)


def default_progress_hook(hooks: Iterable[Hook], every_n_secs: float | None) -> ProgressHook | None:
    """The ProgressHook a session adds to ``hooks`` by default: one every ``every_n_secs``
    seconds when the process runs under ``tensorfleet launch``, ``every_n_secs`` is not
    None and ``hooks`` has no ProgressHook already; else None. (The session runs it on the
    chief only, as every ``chief_only`` hook.) A non-positive ``every_n_secs`` is a
    ConfigError wherever the process runs."""
    if every_n_secs is not None and not every_n_secs > 0:
        raise ConfigError(
            f"progress_secs must be positive (seconds between progress lines) or None (no "
            f"default progress line), got {every_n_secs}"
        )
    if every_n_secs is None or any(isinstance(h, ProgressHook) for h in hooks):
        return None
    if environment.environ().get(environment.LAUNCHER_VAR) != "1":
        return None
    return ProgressHook(every_n_secs)


class ProgressHook(Hook):
    """Print the chief's progress every ``every_n_secs`` seconds and at the end.

    Args:
        every_n_secs: seconds between progress lines (> 0).
        last_step: the global step training ends at; default: the session's
            :class:`StopAtStep`, else unknown (no bar, no time left).
        display: ``"lines"`` (one plain line per interval), ``"rich"`` (rich's progress bar
            on the terminal), or ``"auto"``: rich when stdout is a terminal and the process
            does not run under ``tensorfleet launch``, else lines.
        print_fn: where lines go (default: ``print`` with flush).
        clock: seconds, monotonic (tests pass a fake one).
    """

    chief_only = True

    def __init__(
        self,
        every_n_secs: float = 10.0,
        last_step: int | None = None,
        display: str = "auto",
        print_fn: Callable[[str], None] = _print_line,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not every_n_secs > 0:
            raise ConfigError(f"every_n_secs must be positive, got {every_n_secs}")
        if last_step is not None and last_step < 0:
            raise ConfigError(f"last_step must be >= 0, got {last_step}")
        if display not in ("auto", "lines", "rich"):
            raise ConfigError(f"display must be 'auto', 'lines' or 'rich', got {display!r}")
        self.every_n_secs = float(every_n_secs)
        self._last_step = last_step
        self._stop_hook: StopAtStep | None = None
        self.display = display
        self.print_fn = print_fn
        self.clock = clock
        self._samples: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW + 1)
        self._next_at = 0.0
        self._rich: Any = None
        self._rich_task: Any = None
        #: The latest report printed (None before the first).
        self.latest: ProgressReport | None = None

    @property
    def last_step(self) -> int | None:
        """The last step, once known (given, or the session's StopAtStep's)."""
        if self._last_step is not None:
            return self._last_step
        return None if self._stop_hook is None else self._stop_hook.last_step

    def begin(self, session: TrainingSession) -> None:
        if self._last_step is None:
            self._stop_hook = next((h for h in session.hooks if isinstance(h, StopAtStep)), None)
        now = self.clock()
        self._samples.append((now, session.global_step))
        self._next_at = now + self.every_n_secs
        if self._use_rich():
            self._start_rich(session.global_step)

    def after_step(self, session: TrainingSession, result: StepResult) -> None:
        now = self.clock()
        if self._rich is not None:
            self._update_rich(result.global_step)
        if now >= self._next_at:
            self._report(now, result.global_step)
            self._next_at = now + self.every_n_secs

    def end(self, session: TrainingSession) -> None:
        if self.latest is None or self.latest.step != session.global_step:
            self._report(self.clock(), session.global_step)
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def report(self, now: float, step: int) -> ProgressReport:
        """The report for global step ``step`` at time ``now`` (adds the sample)."""
        if not self._samples or now > self._samples[-1][0]:
            self._samples.append((now, step))
        first_time, first_step = self._samples[0]
        elapsed = now - first_time
        rate = (step - first_step) / elapsed if elapsed > 0 else 0.0
        last = self.last_step
        eta = None
        if last is not None and rate > 0:
            eta = max(0, last - step) / rate
        elif last is not None and step >= last:
            eta = 0.0
        return ProgressReport(step=step, last_step=last, steps_per_s=max(rate, 0.0), eta_s=eta)

    def _report(self, now: float, step: int) -> None:
        self.latest = self.report(now, step)
        if self._rich is None:
            self.print_fn(format_progress_line(self.latest))

    # ------------------------------------------------------------------ rich, on a terminal

    def _use_rich(self) -> bool:
        if self.display != "auto":
            return self.display == "rich"
        under_launcher = environment.environ().get(environment.LAUNCHER_VAR) == "1"
        return sys.stdout.isatty() and not under_launcher

    def _start_rich(self, step: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._rich = Progress(
            TextColumn("global step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
        )
        self._rich_task = self._rich.add_task(
            "training", total=self.last_step, completed=step, rate=""
        )
        self._rich.start()

    def _update_rich(self, step: int) -> None:
        rate = f"{self.latest.steps_per_s:.1f} steps/s" if self.latest is not None else ""
        last = self.last_step
        shown = step if last is None else min(step, last)  # never past the target
        self._rich.update(self._rich_task, completed=shown, total=last, rate=rate)
