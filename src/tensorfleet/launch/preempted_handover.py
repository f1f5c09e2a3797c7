"""A preempted worker's identity goes to its restart as soon as the worker has *left*, not
when its process has exited (a mixin of
:class:`~tensorfleet.launch.supervisor.ClusterSupervisor`).

Why. A worker that gets SIGTERM finishes its step (its push applied), the chief writes its
checkpoint, the worker tells the ps shards it left, and then its process ends with status
143 (:mod:`tensorfleet.session.preemption`). Measured on the loaded 2-core test machine
(1 ps + 3 workers of the CNN example, a warm spare): the step's end and the leaving took
0.01-0.8 s after the SIGTERM (the chief's checkpoint included), the interpreter's teardown
after that (torch's modules and the process's heap; the session had already released
everything) 1.4-2.9 s, and the warm spare's first step another 0.5-1.3 s. The launcher
restarted the task only once it had reaped the exit, so the teardown was most of a
preemption's recovery (2.5-4.4 s p50 before, 1.0-1.2 s after; docs/reliability.md).

How. The preempted worker leaves the marker ``task_markers.LEFT`` with its process id once
it is done with the cluster (nothing is sent after it). The supervising loop looks at the
markers of its running workers every :data:`LEFT_POLL_S` while the run is running; a marker
with the current process's id is that process's exit for the restart policy: status 143 (a
preemption, as the process is about to report), and the restart is scheduled as for that
exit (the same count, back-off and warm spare). The old process, in its own process group,
ends its interpreter meanwhile; it is one of the task's previous processes, and:

- its exit is reported when it comes (a line; a warning when it is not the 143 it promised:
  its lines are shown under the task's prefix as they come), and is not the task's exit;
- it gets the launcher's ``kill_timeout`` (15 s by default) from the marker to exit; then its
  group gets SIGKILL, and a process that even then does not go within another
  ``kill_timeout`` is given up on with an error, as a task stuck in the kernel is;
- the run does not end while such a process is still exiting (an interrupt of the launcher
  does not shorten its deadline: it already had its SIGTERM).

What does not change: a worker the launcher itself stopped (SIGTERM to every task), a run
that no longer restarts (draining, failing, interrupted), or a restart the policy refuses:
the marker is ignored and the exit handled as before. A ps task leaves no such marker (its
successor must listen on its address, which the old process holds until it exits). A
backend whose tasks cannot reach the launcher's marker directory (remote Ray nodes) never
shows the marker, and its tasks are restarted at their exit, as before.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorfleet.errors import PREEMPTED_EXIT_STATUS
from tensorfleet.launch.backends.process_group import READER_DRAIN_TIMEOUT
from tensorfleet.launch.restart_policy import describe_returncode
from tensorfleet.launch.task import Task
from tensorfleet.task_markers import LEFT

if TYPE_CHECKING:
    from tensorfleet.launch.backends.base import TaskProcess
    from tensorfleet.launch.output import Output
    from tensorfleet.task_markers import TaskMarkers

#: Seconds between two looks at the running workers' ``left`` markers: at most this much is
#: added to a preempted worker's recovery (a handful of ``stat`` calls each time).
LEFT_POLL_S = 0.1


@dataclass(eq=False)
class Departing:
    """A process that left the cluster and is still ending; its task already moved on."""

    task: Task
    process: TaskProcess
    left_at: float
    #: When its group gets SIGKILL (or, once killed, when it is given up on).
    deadline: float
    killed: bool = False


class PreemptedHandover:
    """Restarts a preempted worker once it has left (mixed into ``ClusterSupervisor``, which
    provides the attributes below, ``_restarts_allowed``, ``_restart_delay`` and
    ``_schedule_restart``)."""

    _tasks: list[Task]
    _markers: TaskMarkers
    kill_timeout: float
    output: Output

    if TYPE_CHECKING:

        def _restarts_allowed(self) -> bool: ...
        def _restart_delay(self, task: Task) -> float | None: ...
        def _schedule_restart(self, task: Task, delay: float, left: str | None = None) -> None: ...

    def _init_handover(self) -> None:
        #: Processes that left and are still ending, oldest first.
        self._departing: list[Departing] = []

    def _watching_for_left(self) -> bool:
        """Whether the loop looks at the markers: the run restarts tasks and a worker runs."""
        return (
            self._markers.directory is not None
            and self._restarts_allowed()
            and any(t.job == "worker" and t.running and not t.restart_pending for t in self._tasks)
        )

    def _handover_deadlines(self, now: float) -> list[float]:
        """When the supervising loop wakes up for this module: its next look at the markers,
        and each departing process's deadline."""
        deadlines = [d.deadline for d in self._departing]
        if self._watching_for_left():
            deadlines.append(now + LEFT_POLL_S)
        return deadlines

    def _hand_over_left_workers(self, now: float) -> None:
        """Schedule the restart of every running worker whose current process left (its
        marker holds that process's id); call before the restarts due are started."""
        if not self._watching_for_left():
            return
        for task in self._tasks:
            if (
                task.job != "worker"
                or not task.running
                or task.restart_pending
                or task.stop_signal is not None
                or task.process is None
                or task.process.returncode is not None  # reaped: its exit event handles it
                or not self._markers.has(task.name, LEFT)
                or self._markers.read(task.name, LEFT) != str(task.pid)
            ):
                continue
            self._hand_over(task, now)

    def _hand_over(self, task: Task, now: float) -> None:
        """``task``'s process left: its exit, for the restart policy, is the preemption's."""
        process = task.process
        assert process is not None
        task.returncode, task.ended_at = PREEMPTED_EXIT_STATUS, now
        delay = self._restart_delay(task)
        if delay is None:  # its exit decides, as before (the policy refuses a restart)
            task.returncode = task.ended_at = None
            return
        self._departing.append(Departing(task, process, now, now + self.kill_timeout))
        self.output.task_exited(task.name, "left (preempted); restarting", False)
        self._schedule_restart(
            task,
            delay,
            left=(
                f"left the cluster (preempted: its last push applied; pid {task.pid} ends its "
                f"interpreter meanwhile, SIGKILL if it has not within {self.kill_timeout:g} s)"
            ),
        )

    def _departed_exit(self, process: TaskProcess | None) -> bool:
        """When ``process`` (that of an exit event) is one that left, report its exit and
        return True: it is not its task's exit."""
        found = [d for d in self._departing if d.process is process and process is not None]
        if not found:
            return False
        departing = found[0]
        self._departing.remove(departing)
        process.finish_output(READER_DRAIN_TIMEOUT)
        rc = process.returncode
        assert rc is not None
        task = departing.task
        took = time.monotonic() - departing.left_at
        if rc == PREEMPTED_EXIT_STATUS:
            self.output.message(
                f"{task.name}'s preempted process (pid {process.pid}) exited {rc}, "
                f"{took:.1f} s after it left"
            )
        elif departing.killed:
            self.output.message(
                f"{task.name}'s preempted process (pid {process.pid}) ended "
                f"({describe_returncode(rc)}) once killed",
                "warning",
            )
        else:
            # Not the task's failure (it had left: push applied, checkpoint written), but
            # something went wrong while its interpreter ended: shown, not swallowed.
            self.output.message(
                f"{task.name}'s preempted process (pid {process.pid}) ended with "
                f"{describe_returncode(rc)} {took:.1f} s after it left, not with the "
                f"{PREEMPTED_EXIT_STATUS} of a preemption; its restart already runs. Its output "
                "since it left is above, under its task's prefix",
                "warning",
            )
        return True

    def _on_departing_deadlines(self, now: float) -> None:
        """SIGKILL a departing process's group at its deadline; give up on one that even
        then did not go."""
        for departing in [d for d in self._departing if now >= d.deadline]:
            name, pid = departing.task.name, departing.process.pid
            if not departing.killed:
                self.output.message(
                    f"{name}'s preempted process (pid {pid}) did not exit within "
                    f"{self.kill_timeout:g} s after it left; killing it with SIGKILL",
                    "warning",
                )
                departing.process.signal_group(signal.SIGKILL)
                departing.killed = True
                departing.deadline = now + self.kill_timeout
            else:
                self.output.message(
                    f"{name}'s preempted process (pid {pid}) did not exit within "
                    f"{self.kill_timeout:g} s of SIGKILL (stuck in the kernel?); giving up on it",
                    "error",
                )
                self._departing.remove(departing)
