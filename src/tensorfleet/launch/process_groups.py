"""The processes of a supervised cluster's tasks: starting one through the backend, and
signalling the process groups. A mixin of
:class:`~tensorfleet.launch.supervisor.ClusterSupervisor`, which decides when; this module
does it.

Rule. Every task runs in a process group of its own; a signal meant for a task goes to its
whole group (children included). A task's output lines go to the current process's
``recent`` deque (a late line of a process that was replaced stays out of the new one's
failure report) and to the output; its exit arrives as an ``("exit", (task, process))``
event on the supervisor's queue.

Invariant. Nothing a task started outlives the run: the final sweep SIGKILLs the group of
every task's current process and of every process it had before a restart.
"""

from __future__ import annotations

import queue
import signal
import time
from typing import TYPE_CHECKING

from tensorfleet.errors import LaunchError
from tensorfleet.launch.restart_policy import describe_returncode
from tensorfleet.launch.task import Task

if TYPE_CHECKING:
    from tensorfleet.launch.backends.base import Backend, TaskProcess
    from tensorfleet.launch.output import Output


class ProcessGroups:
    """Starts tasks and signals their process groups (mixed into ``ClusterSupervisor``,
    which provides the attributes below, ``task`` and ``task_variables``)."""

    _tasks: list[Task]
    _events: queue.SimpleQueue[tuple[str, object]]
    _cwd: str | None
    backend: Backend
    output: Output

    def kill_task(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process group of task ``name``'s current process, as if it died
        on its own: for fault-injection tests and chaos drills.

        The launcher handles the exit like any other failure (a restart when the policy
        allows one, else a report and the others stopped). Safe to call from any thread: it
        only sends a signal. Raises :class:`LaunchError` for an unknown task, an unknown
        signal, or a task that is not running (not started, exited, or waiting for a restart).
        """
        task = self.task(name)
        try:
            sig_name = signal.Signals(sig).name
        except ValueError:
            raise LaunchError(
                f"cannot send signal {sig!r} to {name}: not a signal number; "
                "use one of signal.Signals, e.g. signal.SIGKILL"
            ) from None
        process = task.process
        if process is None:
            raise LaunchError(f"{name} is not running: the cluster was not started; call start()")
        if task.restart_pending:
            raise LaunchError(f"{name} is not running: it failed and waits to be restarted")
        returncode = process.returncode  # set by the backend once the process is reaped
        if returncode is not None or not task.running:
            how = "" if returncode is None else f" ({describe_returncode(returncode)})"
            raise LaunchError(f"{name} is not running: it already ended{how}")
        if not process.signal_group(sig):
            raise LaunchError(f"cannot send {sig_name} to {name} (pid {process.pid}): it is gone")

    def _spawn(self, task: Task, restarted: bool = False) -> None:
        """Start ``task`` through the backend, its lines to ``task.recent`` and the output."""
        recent = task.recent  # this process's deque: a late line of an old one stays out

        # the exit event names the process too: one that left the cluster and still ended
        # after its task was restarted is not the task's exit (launch/preempted_handover.py);
        # an exit before spawn() returned is the current process's (None)
        spawned: list[TaskProcess] = []

        def on_line(text: str) -> None:
            recent.append(text)
            self.output.line(task.name, text)

        process = self.backend.spawn(
            task.name,
            task.command,
            self.task_variables(task, restarted),
            self._cwd,
            on_line,
            lambda: self._events.put(("exit", (task, spawned[0] if spawned else None))),
        )
        spawned.append(process)
        task.process, task.started_at = process, time.monotonic()
        self.output.task_started(task.name, process.pid)

    def _signal_running(self, sig: int) -> list[Task]:
        """Send ``sig`` to the process group of every task still running; return those tasks."""
        signalled = []
        for task in self._tasks:
            if not task.running or task.process is None:
                continue
            if task.process.returncode is None:  # not yet reaped
                task.stop_signal = sig
                signalled.append(task)
            task.process.signal_group(sig)
        return signalled

    def _kill_process_groups(self, quiet: bool) -> None:
        """SIGKILL whatever is left in each task's process group (children of a task that
        outlived it), those of its processes before a restart too. Warns about the current
        groups that still had members unless ``quiet``."""
        for task in self._tasks:
            for process in task.previous:  # already killed at the restart; this is a sweep
                process.signal_group(signal.SIGKILL)
            if task.process is None:
                continue
            if not quiet and task.process.signal_group(0):
                self.output.message(
                    f"{task.name} left processes behind in its process group; killing them",
                    "warning",
                )
            task.process.signal_group(signal.SIGKILL)
