"""Restarting a failed task in place, for :class:`~tensorfleet.launch.supervisor.ClusterSupervisor`
(a mixin): the back-off, the announcement, the restart itself, and the cancellation of
restarts that are no longer allowed. Whether a failure is restarted, and after how long, is
the :class:`~tensorfleet.launch.restart_policy.RestartPolicy`'s.

Rule. A task that ends on its own with a failure while the run is running is restarted
when the policy allows it: what its old process group left behind is killed at once, and
after the policy's back-off (none for a task that ran longer than the crash-loop threshold;
otherwise a deadline the supervising loop wakes up for, never a sleep) the same command runs
with the same environment plus ``TENSORFLEET_PREDECESSOR_DEAD=1`` (for a worker, in the warm
spare when one is ready: :mod:`tensorfleet.launch.warm_spares`).
Once the run drains, fails, or is stopped or interrupted, a restart still waiting is
cancelled and the task counts as failed.

Invariant. A task has at most one restart pending; a restart that cannot start is reported
as the task's failure, and ``restarts`` / ``restart_history`` count only restarts that started.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from typing import TYPE_CHECKING

from tensorfleet.launch.restart_policy import RestartDecision, describe_returncode
from tensorfleet.launch.task import Task
from tensorfleet.task_markers import LEFT, SERVING

if TYPE_CHECKING:
    from tensorfleet.launch.output import Output
    from tensorfleet.launch.restart_policy import RestartPolicy
    from tensorfleet.task_markers import TaskMarkers


class TaskRestarts:
    """Restarts failed tasks in place (mixed into ``ClusterSupervisor``, which provides the
    attributes below and ``_restarts_allowed``, ``_on_failure``, ``_spawn``, ``_take_spare``
    and ``task_variables``)."""

    _tasks: list[Task]
    _interrupt: int | None
    _phase: str
    output: Output
    restart_policy: RestartPolicy
    _markers: TaskMarkers

    def _decide_restart(
        self, task: Task, returncode: int | None = None, replaced: bool | None = None
    ) -> RestartDecision:
        """The policy's decision for ``task``, which just ended with a failure: its run time
        (from its start to its exit), whether that process got to work (it left
        ``task_markers.SERVING`` with its pid), whether it was preempted and left cleanly
        (``task_markers.LEFT`` with its pid) and its crash streak decide the back-off.

        ``returncode``: decide for a task still running as if it ended so now (the launcher
        asks before it kills a stopped ps, :mod:`tensorfleet.launch.stopped_ps`);
        ``replaced``: whether the launcher killed it for that (None: as ``task`` says)."""
        if returncode is None:
            assert task.returncode is not None
            returncode = task.returncode
        if task.returncode is not None:
            ran = (task.ended_at or task.started_at) - task.started_at
        else:  # still running: asked before the launcher kills it
            ran = time.monotonic() - task.started_at
        pid = str(task.pid) if task.pid is not None else None
        served = pid is not None and self._markers.read(task.name, SERVING) == pid
        left = pid is not None and self._markers.read(task.name, LEFT) == pid
        return self.restart_policy.decide(
            returncode,
            task.restart_history,
            time.monotonic(),
            ran,
            task.quick_deaths,
            served=served,
            left=left,
            replaced=task.replaced_because is not None if replaced is None else replaced,
        )

    def _restart_delay(self, task: Task) -> float | None:
        """The back-off before ``task``, which just failed on its own, is restarted; None when
        it is reported instead (restarts not allowed now, or the policy says no)."""
        if not self._restarts_allowed():
            return None
        decision = self._decide_restart(task)
        return decision.delay_s if decision.restart else None

    def _schedule_restart(self, task: Task, delay: float, left: str | None = None) -> None:
        """Announce the failure of ``task``, kill what its process group left behind (it
        could hold the task's port or files), and set the restart's deadline: the supervising
        loop wakes up for it like for a phase deadline.

        ``left``: the task's process left the cluster and is still ending its interpreter
        (:mod:`tensorfleet.launch.preempted_handover`); its group is not killed, and ``left``
        says so in the announcement instead of the exit status."""
        assert task.process is not None and task.returncode is not None
        if left is None:
            if task.process.signal_group(0):
                self.output.message(
                    f"{task.name} left processes behind in its process group; killing them "
                    "before restarting it",
                    "warning",
                )
            task.process.signal_group(signal.SIGKILL)
        decision = self._decide_restart(task)
        # the crash streak: quick deaths in a row double the back-off; a long run ends it
        task.quick_deaths = task.quick_deaths + 1 if decision.crash_loop else 0
        task.restart_at, task.pending_restart = time.monotonic() + delay, decision
        lines = list(task.recent)
        last = f" Its last line: {lines[-1]}" if lines else " It printed nothing."
        failed = f"failed with {describe_returncode(task.returncode)}"
        ended = left or task.replaced_because or failed
        task.replaced_because = None
        self.output.message(
            f"{task.name} {ended}; restarting it "
            f"({decision.describe_count()}) {decision.describe_wait()} "
            f"(pid {task.pid}).{last}",
            "warning",
        )

    def _on_restarts_due(self, now: float) -> None:
        """Restart the tasks whose back-off has passed, or, once the run is no longer
        running (draining, failing, stopping, interrupted), cancel every pending restart:
        such a task then counts as failed."""
        pending = [t for t in self._tasks if t.restart_at is not None]
        if not pending:
            return
        for task in pending:
            if not self._restarts_allowed():
                why = "interrupted" if self._interrupt is not None else self._phase
                task.restart_at = task.pending_restart = None
                self.output.message(f"not restarting {task.name}: the run is {why}", "warning")
                self._on_failure(task)
            elif task.restart_at is not None and now >= task.restart_at:
                task.restart_at = None
                self._restart(task)  # on failure to start, restarts are no longer allowed

    def _restart(self, task: Task) -> None:
        """Start ``task`` again with the same command and environment (its identity), telling
        it that its predecessor is dead: in a warm spare when one can take it
        (:mod:`tensorfleet.launch.warm_spares`), else in a new process."""
        assert task.process is not None and task.returncode is not None
        old_process, old_recent = task.process, task.recent
        decision, task.pending_restart = task.pending_restart, None
        assert decision is not None
        # The new process's lines; a failure report must not show the old process's lines
        # as if the new one printed them (the log keeps them all).
        task.recent = deque(maxlen=old_recent.maxlen)
        try:
            spare = self._take_spare(task, self.task_variables(task, restarted=True))
            if spare is None:
                self._spawn(task, restarted=True)
        except OSError as exc:
            task.recent = old_recent
            self.output.message(
                f"cannot restart {task.name} with command {task.command!r}: {exc}", "error"
            )
            self._on_failure(task)
            return
        task.previous.append(old_process)
        task.restarts += 1
        task.restart_history.append((time.monotonic(), decision.history_kind))
        task.returncode = task.stop_signal = task.ended_at = None
        where = (
            ""
            if task.process is None or task.process.host == "local"
            else f" on {task.process.host}"
        )
        how = (
            ""
            if spare is None
            else f": warm spare {spare.name}, started {time.monotonic() - spare.started_at:.1f} "
            + ("s ago and waiting" if spare.ready else "s ago, still starting")
        )
        self.output.message(
            f"restarted {task.name} ({decision.describe_count()}) as pid {task.pid}{where}{how}"
        )
