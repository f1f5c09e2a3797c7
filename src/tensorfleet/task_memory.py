"""A task's peak memory (resident set size): measured in the task, left for the launcher.

What is measured: the most physical memory the process ever held (Linux ``VmHWM`` in
``/proc/self/status``; elsewhere ``resource.getrusage``'s ``ru_maxrss``), in bytes. It is
the number that decides whether a task fits its machine (and whether the OOM killer comes),
which ``--max-memory`` only bounds for the tables.

Where it goes: a ps shard puts it in its ``stats`` reply (``TrainingSession.cluster_stats()``,
``peak_rss_bytes``); and every task a launcher supervises writes it, when its interpreter
exits, next to its other facts for the launcher (:mod:`tensorfleet.task_markers`: one file
``<task>.peak-rss`` holding the number), which the launcher's end-of-run summary lists
(:mod:`tensorfleet.launch.peak_memory`). A task killed by SIGKILL writes nothing, and the
summary says so. Shared by every layer (it imports nothing of tensorfleet but the markers).
"""

from __future__ import annotations

import atexit
import resource
import sys
from collections.abc import Mapping

from tensorfleet import task_markers

#: The marker a task leaves: its peak RSS in bytes, as decimal text.
PEAK_RSS = "peak-rss"

_registered: set[str] = set()


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes


def record_at_exit(task_name: str, environ_: Mapping[str, str] | None = None) -> None:
    """When a launcher supervises this process, leave this task's peak RSS for it when the
    interpreter exits (once per task name; nothing without a launcher)."""
    if task_name in _registered or not task_markers.markers_directory(environ_):
        return
    _registered.add(task_name)
    atexit.register(write_now, task_name, environ_)


def write_now(task_name: str, environ_: Mapping[str, str] | None = None) -> None:
    """Leave this task's peak RSS so far for the launcher (what :func:`record_at_exit` runs)."""
    task_markers.mark(PEAK_RSS, task_name, environ_, text=str(peak_rss_bytes()))
