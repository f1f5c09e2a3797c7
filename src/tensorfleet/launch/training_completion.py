"""When a supervised run's training is complete, and what a worker's end means after that.

The rule: **in a cluster with ps tasks, training is complete once the chief and every ps
task have exited 0.** The chief exits 0 only after it declared the end of training and wrote
the final checkpoint; a ps task exits 0 only once every worker is done or lost. (Without ps
tasks, in all-reduce mode, no such moment exists short of every worker's own exit 0: the rule
never applies there.) From then on the model is finished and
saved: nothing a worker does can add to it.

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

from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.launch.task import Task


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


def retired_after_completion(task: Task, tasks: Sequence[Task], cluster: ClusterSpec) -> bool:
    """True when ``task``, which just ended, is a worker killed by a signal (or stopped by
    the launcher) after training was complete: it is then retired, not failed nor restarted."""
    assert task.returncode is not None
    by_signal = task.returncode < 0 or task.stop_signal is not None
    return task.job != "ps" and by_signal and training_complete(tasks, cluster)
