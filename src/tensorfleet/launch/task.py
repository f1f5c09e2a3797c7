"""One task of a supervised cluster: its identity, its current process, and its history.

Backend-neutral: the process is a :class:`~tensorfleet.launch.backends.base.TaskProcess`,
a child of this launcher or a process on a Ray node.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tensorfleet.errors import LaunchError
from tensorfleet.launch.backends.base import TaskProcess
from tensorfleet.launch.restart_policy import SIGNAL, RestartDecision


@dataclass(eq=False)
class Task:
    """One task of the cluster, its process, and what the launcher knows about it."""

    job: str
    index: int
    command: list[str]
    #: The latest output lines of its current process (a fresh deque at each restart).
    recent: deque[str]
    #: The current process; None before the cluster starts.
    process: TaskProcess | None = None
    #: ``Popen.returncode`` once the launcher has handled the exit (negative: signal).
    returncode: int | None = None
    #: The last signal the launcher sent; a task it stopped is not reported as failed.
    stop_signal: int | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    #: How many times the launcher restarted this task after a failure.
    restarts: int = 0
    #: ``time.monotonic()`` at which a scheduled restart is due; None when none is pending.
    restart_at: float | None = None
    #: The policy's decision for the pending restart (its kind and count), if any.
    pending_restart: RestartDecision | None = None
    #: Deaths in a row that came soon after the process started (a crash loop's): each
    #: doubles the back-off before the next restart; a run past the policy's threshold
    #: resets it (:mod:`tensorfleet.launch.restart_policy`).
    quick_deaths: int = 0
    #: ``(time.monotonic(), kind)`` of each restart, for the restart policy's window.
    restart_history: list[tuple[float, str]] = field(default_factory=list, repr=False)
    #: The processes this task ran before its latest restart, so that whatever their process
    #: groups still hold is killed at the end of the run.
    previous: list[TaskProcess] = field(default_factory=list, repr=False)
    #: Ended (or its restart cancelled) after training was complete: not a failure
    #: (:mod:`tensorfleet.launch.training_completion`).
    retired: bool = False
    #: Why the launcher itself killed the current process so that it is restarted (a ps
    #: that stayed stopped: :mod:`tensorfleet.launch.stopped_ps`); said in the restart's
    #: line instead of the exit status, then cleared. None: it failed on its own.
    replaced_because: str | None = None

    @property
    def name(self) -> str:
        """``"worker:1"``: the prefix of the task's output lines."""
        return f"{self.job}:{self.index}"

    @property
    def pid(self) -> int | None:
        """The process id (also its process group id), once started."""
        return None if self.process is None else self.process.pid

    @property
    def previous_pids(self) -> list[int]:
        """Process ids of the processes this task ran before its latest restart."""
        return [process.pid for process in self.previous]

    @property
    def running(self) -> bool:
        """Started and its exit not yet handled."""
        return self.process is not None and self.returncode is None

    @property
    def pending_signal_restart(self) -> bool:
        """A restart is pending after this task was killed by a signal."""
        return self.pending_restart is not None and self.pending_restart.kind == SIGNAL

    @property
    def restart_pending(self) -> bool:
        """Failed, and waiting for its back-off to pass before the launcher restarts it."""
        return self.restart_at is not None


def as_argv(command: Sequence[str], what: str) -> list[str]:
    """``command`` as the argument list a task runs, or LaunchError naming ``what`` and
    the fix (a string instead of a list, an empty list)."""
    if isinstance(command, (str, bytes)):
        raise LaunchError(
            f"the {what} must be a list of arguments, got the string {command!r}; "
            "split it with shlex.split()"
        )
    argv = [os.fspath(arg) for arg in command]
    if not argv:
        raise LaunchError(f"the {what} is empty; give the program to run and its arguments")
    return argv
