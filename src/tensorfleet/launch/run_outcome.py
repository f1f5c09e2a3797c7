"""The verdict of a supervised run once every task has exited: its exit status, and the
line that says how it ended.

One rule, in one place: a task failure's status wins (the cluster was stopped for it), then an
interrupt of the launcher (128 + the signal), then 0 when every worker finished (or retired
after training was complete), else the first unfinished worker's signal status (143 for a
SIGTERM from :meth:`ClusterSupervisor.stop`), or 1 for a worker that could not be reaped.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorfleet.launch.restart_policy import exit_status
from tensorfleet.launch.task import Task


def run_status(
    workers: Sequence[Task], failure_returncode: int | None, interrupt: int | None
) -> int:
    """The exit status of a run whose worker tasks are ``workers`` (see the module)."""
    if failure_returncode is not None:
        return exit_status(failure_returncode)
    if interrupt is not None:
        return 128 + interrupt
    if all(t.returncode == 0 or t.retired for t in workers):
        return 0
    codes = [t.returncode for t in workers if t.returncode != 0 and not t.retired]
    return exit_status(codes[0]) if codes[0] is not None else 1


def ending_line(status: int, workers: Sequence[Task], elapsed_s: float) -> str:
    """The launcher's last line about the run (before the peak-memory line)."""
    if status != 0:
        return f"exit status {status} after {elapsed_s:.1f} s"
    retired = [t.name for t in workers if t.retired]
    late = f" ({', '.join(retired)} ended after training was complete)" if retired else ""
    return f"all {len(workers)} worker(s) finished in {elapsed_s:.1f} s{late}"
