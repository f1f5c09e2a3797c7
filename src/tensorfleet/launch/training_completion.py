"""When a supervised run's training is complete, and what a worker's end means after that.

The rule: **in a cluster with ps tasks, training is complete once the chief and every ps
task have exited 0.** The chief exits 0 only after it declared the end of training and wrote
the final checkpoint; a ps task exits 0 only once every worker is done or lost. (Without ps
tasks, in all-reduce mode, no such moment exists short of every worker's own exit 0: the rule
never applies there.) From then on the model is finished and
saved: nothing a worker does can add to it.

In all-reduce mode the same holds for a worker that *itself* passed the end of training (the
final checkpoint, then the barrier every worker reaches), which it tells the launcher with a
marker (:mod:`tensorfleet.task_markers`): killed by a signal after that (torch's gloo backend
can abort a process at interpreter exit), it is retired too, since a restart could never
rejoin the ended group. Other workers of a cluster without ps tasks (actors, ensemble members:
any program) are restarted as before.

So a worker that is *killed by a signal* after that moment (a preemption landing on the last
step, the chaos run's SIGKILL, or the launcher's own SIGTERM to a worker still running when
the grace period ends) is *retired*: reported with a warning and its last line, never
restarted, and not a failure of the run. A restart after a signal still waiting for its
back-off is cancelled the same way, and a restarted worker still running (waiting for a ps that has
gone) gets the grace period, then SIGTERM. A worker that exits with an *error* after
training completed still fails the run: its traceback is a bug to see, not a preemption.

Invariant: once training is complete, no worker killed by a signal is started again, and no
signal changes the run's exit status (0 unless it was interrupted, a task had already failed
for good, or a worker exits with an error).

The alternative, restarting such a worker as during training, left the run's status to
chance: in a chaos run (seed 2, 5,000 steps) worker:1 was killed on the last step, its
restart came up after the chief and the ps had exited, waited 62 s for a ps that would never
answer and ended the run with exit status 2 though training had completed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.launch.task import Task
from tensorfleet.task_markers import COLLECTIVE_END, TaskMarkers

if TYPE_CHECKING:
    from tensorfleet.launch.output import Output


def training_complete(tasks: Sequence[Task], cluster: ClusterSpec) -> bool:
    """True once the cluster has ps tasks and the chief (:meth:`ClusterSpec.chief_task`) and
    every ps task exited 0."""
    if not any(t.job == "ps" for t in tasks):
        return False
    chief = cluster.chief_task()
    ended_well = {(t.job, t.index) for t in tasks if t.returncode == 0 and not t.restart_pending}
    if (chief.job, chief.index) not in ended_well:
        return False
    return all((t.job, t.index) in ended_well for t in tasks if t.job == "ps")


def retired_after_completion(
    task: Task, tasks: Sequence[Task], cluster: ClusterSpec, markers: TaskMarkers | None = None
) -> bool:
    """True when ``task``, which just ended, is a worker killed by a signal (or stopped by
    the launcher) after training was complete, or after it passed the end of all-reduce
    training (its marker in ``markers``): it is then retired, not failed nor restarted."""
    assert task.returncode is not None
    by_signal = task.returncode < 0 or task.stop_signal is not None
    if task.job == "ps" or not by_signal:
        return False
    passed_end = markers is not None and markers.has(task.name, COLLECTIVE_END)
    return passed_end or training_complete(tasks, cluster)


class TrainingCompletion:
    """The end of a run for :class:`~tensorfleet.launch.supervisor.ClusterSupervisor` (a
    mixin, which provides the attributes below): when the run may drain, and the retiring of
    workers that end after training is complete."""

    _tasks: list[Task]
    cluster: dict[str, list[str]]
    grace_period: float
    output: Output

    def _run_is_over(self) -> bool:
        """True once every worker exited 0 (the ps tasks then exit by themselves) or once
        training is complete; then a restart after a signal still waiting is cancelled, and
        the caller gives the tasks still running the grace period to exit."""
        workers = [t for t in self._tasks if t.job == "worker"]
        if all(t.returncode == 0 or t.retired for t in workers):
            ps_left = [t.name for t in self._tasks if t.running]
            if ps_left:
                self.output.message(
                    f"all workers finished; waiting up to {self.grace_period:g} s for "
                    f"{', '.join(ps_left)} to exit"
                )
            return True
        if not training_complete(self._tasks, ClusterSpec(self.cluster)):
            return False
        for task in [t for t in workers if t.restart_pending and t.pending_signal_restart]:
            task.restart_at = task.pending_restart = None
            self._retire(task, "restart cancelled")
        left = [t.name for t in workers if t.running]
        if left:
            self.output.message(
                "training is complete (the chief and every ps task exited 0); giving "
                f"{', '.join(left)} up to {self.grace_period:g} s to exit"
            )
        return True

    def _retire(self, task: Task, what: str) -> None:
        """Report a worker that ended after training was complete: not a failure, and not
        restarted."""
        task.retired = True
        lines = list(task.recent)
        last = f"; its last line: {lines[-1]}" if lines else ""
        if any(t.job == "ps" for t in self._tasks):
            why = "the chief and every ps task had exited 0"
        else:
            why = "it had passed the final barrier of all-reduce training"
        self.output.message(
            f"{task.name}: {what}; not restarting it, and not a failure: training was "
            f"complete ({why}){last}",
            "warning",
        )
