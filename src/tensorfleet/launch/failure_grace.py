"""The grace period after a failure, and when it is skipped: a mixin of
:class:`~tensorfleet.launch.supervisor.ClusterSupervisor`.

Rule. When a task fails for good, the tasks still running get ``grace_period`` seconds to
finish (a worker may be writing a checkpoint, the chief reporting), then SIGTERM, then
SIGKILL. The grace period is the workers': once no worker is left, neither running nor
waiting for a restart, the ps tasks have nobody to serve and nothing to wait for, so they get
SIGTERM at once, with a line saying why (they take it as a preemption and exit cleanly). A
typo in the workers' command line, which makes every worker exit 2 within seconds, then costs
those seconds, not the grace period.

The announcement of the grace period names only the tasks whose process is still running: a
task whose exit the supervising loop has not handled yet, but whose process the backend has
already reaped, has ended, and is not given a grace period. When that leaves no worker, no
grace period is announced at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorfleet.launch.task import Task

if TYPE_CHECKING:
    from tensorfleet.launch.output import Output


class FailureGrace:
    """Announces, or skips, the grace period after a failure (mixed into
    ``ClusterSupervisor``, which provides the attributes below and moves through the phases)."""

    _tasks: list[Task]
    grace_period: float
    output: Output

    def _announce_grace_period(self) -> None:
        """After the first failure that is not restarted: name the tasks still running that
        get the grace period; nothing when no worker is left (they are stopped at once)."""
        alive = [t for t in self._tasks if t.running and not _reaped(t)]
        if not any(t.job == "worker" for t in alive) and not self._workers_pending():
            return
        if alive:
            self.output.message(
                f"giving {', '.join(t.name for t in alive)} up to {self.grace_period:g} s to "
                "finish, then stopping them"
            )

    def _skip_grace_period(self) -> bool:
        """During the grace period after a failure: True, after saying so, when no worker is
        left running or waiting for a restart (the caller then stops the others at once)."""
        if any(t.job == "worker" and t.running for t in self._tasks) or self._workers_pending():
            return False
        left = [t.name for t in self._tasks if t.running]
        if left:
            self.output.message(
                f"no worker is left running: stopping {', '.join(left)} now rather than after "
                f"the {self.grace_period:g} s grace period"
            )
        return True

    def _workers_pending(self) -> bool:
        """Whether a worker waits for its restart (it will be cancelled, but has not been)."""
        return any(t.job == "worker" and t.restart_pending for t in self._tasks)


def _reaped(task: Task) -> bool:
    """The backend has reaped ``task``'s process, though its exit may not be handled yet."""
    return task.process is not None and task.process.returncode is not None
