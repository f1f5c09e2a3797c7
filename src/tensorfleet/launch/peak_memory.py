"""The launcher's end-of-run line on each task's peak memory (resident set size).

Each task leaves its peak RSS when it exits (:mod:`tensorfleet.task_memory`); the supervisor
prints, after its summary line, one line naming every task's::

    peak memory (RSS): ps:0 212.4 MiB, ps:1 208.0 MiB, worker:0 401.7 MiB, worker:1 ? (no record: ended by SIGKILL)

A task that left no record shows ``?`` and, from its exit status, why: ended by a signal (a
SIGKILL leaves nothing), or exited without having started a ``tfl.Server`` (what registers
the record: a script that ends before it, or a command that is not a tensorfleet program).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tensorfleet.launch.restart_policy import signal_name
from tensorfleet.task_markers import TaskMarkers
from tensorfleet.task_memory import PEAK_RSS


def peak_memory_line(
    task_names: Sequence[str],
    markers: TaskMarkers,
    returncodes: Mapping[str, int | None] | None = None,
) -> str | None:
    """The summary line for ``task_names`` (None when no task left a record: nothing to say,
    e.g. the command is not a tensorfleet program); ``returncodes``: each task's last
    ``Popen.returncode``, which says why a task left no record."""
    parts, known = [], 0
    for name in task_names:
        text = markers.read(name, PEAK_RSS)
        try:
            value = int(text) if text is not None else None
        except ValueError:
            value = None
        if value is None:
            parts.append(f"{name} ? (no record{_why_none((returncodes or {}).get(name))})")
        else:
            known += 1
            parts.append(f"{name} {format_bytes(value)}")
    return f"peak memory (RSS): {', '.join(parts)}" if known else None


def _why_none(returncode: int | None) -> str:
    """Why a task that exited with ``returncode`` left no record ("" when unknown)."""
    if returncode is None:
        return ""
    if returncode < 0:
        return f": ended by {signal_name(-returncode)}"
    return f": it exited (code {returncode}) without starting a tfl.Server"


def format_bytes(nbytes: int) -> str:
    """``212.4 MiB``, ``1.21 GiB``, ``512 KiB``."""
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes // 1024} KiB"
