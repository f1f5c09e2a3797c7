"""The chief's progress line: what it says, how it is written, and how the launcher reads it.

One line per interval, plain ASCII, no control characters, readable in a log and parsed by
the launcher's live view::

    [progress] global step 1200/3000 [########............] 40% 41.2 steps/s, 0:00:44 left
    [progress] global step 1200 (no last step) 41.2 steps/s
    [progress] global step 18/18 [####################] 100% (+1 in flight past the last step) 9.1 steps/s, 0:00:00 left

The step shown never passes the last step (the target) and the bar never passes 100 %: in async
training the pushes in flight when the chief reached the last step still count, so the
global step may end a little past it; the line then says by how much.

Written by :class:`~tensorfleet.session.progress_hook.ProgressHook` on the chief; read by
:mod:`tensorfleet.launch.output`. This module imports nothing heavy (no torch), so that the
launcher can parse lines without loading the training stack.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: The first word of every progress line.
PREFIX = "[progress]"
#: Characters of the bar in a progress line.
BAR_WIDTH = 20

_LINE = re.compile(
    r"\[progress\] global step (?P<step>\d+)(?:/(?P<last>\d+))?"
    r".*?(?P<rate>\d+(?:\.\d+)?) steps/s(?:, (?P<eta>\d+:\d\d:\d\d|\?) left)?\s*$"
)


@dataclass(frozen=True)
class ProgressReport:
    """Where training stands: the global step, the last step (None: unknown), the global
    steps per second over the latest interval, and the seconds left (None: unknown)."""

    step: int
    last_step: int | None
    steps_per_s: float
    eta_s: float | None

    @property
    def fraction(self) -> float | None:
        """Done fraction in [0, 1], or None without a last step."""
        if self.last_step is None:
            return None
        if self.last_step <= 0:
            return 1.0
        return min(1.0, max(0.0, self.step / self.last_step))


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded)."""
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def format_progress_line(report: ProgressReport) -> str:
    """The progress line of ``report`` (see the module docstring)."""
    rate = f"{report.steps_per_s:.1f} steps/s"
    fraction = report.fraction
    if fraction is None:
        return f"{PREFIX} global step {report.step} (no last step) {rate}"
    filled = int(fraction * BAR_WIDTH)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    eta = "?" if report.eta_s is None else format_duration(report.eta_s)
    shown, past = report.step, ""
    if report.last_step is not None and report.step > report.last_step:
        # Async pushes already in flight when the last step was reached count past it.
        shown = report.last_step
        past = f" (+{report.step - report.last_step} in flight past the last step)"
    return (
        f"{PREFIX} global step {shown}/{report.last_step} [{bar}] "
        f"{fraction * 100:.0f}%{past} {rate}, {eta} left"
    )


def parse_progress_line(text: str) -> ProgressReport | None:
    """The report in a progress line, or None when ``text`` is not one."""
    if PREFIX not in text:
        return None
    match = _LINE.search(text)
    if match is None:
        return None
    last = match.group("last")
    eta = match.group("eta")
    eta_s: float | None = None
    if eta is not None and eta != "?":
        hours, minutes, seconds = (int(part) for part in eta.split(":"))
        eta_s = float(hours * 3600 + minutes * 60 + seconds)
    rate = float(match.group("rate"))
    return ProgressReport(
        step=int(match.group("step")),
        last_step=None if last is None else int(last),
        steps_per_s=rate if math.isfinite(rate) else 0.0,
        eta_s=eta_s,
    )
