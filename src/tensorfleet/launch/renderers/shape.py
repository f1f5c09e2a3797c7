"""The cluster shape a renderer describes: how many ps tasks and how many worker tasks.

Every renderer takes the same shape and checks it the same way, here, so that ``tensorfleet
slurm`` and ``tensorfleet k8s render`` refuse the same bad input with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorfleet.cluster.spec import TaskId, show
from tensorfleet.errors import ClusterConfigError


@dataclass(frozen=True)
class ClusterShape:
    """``ps`` parameter-server tasks and ``workers`` worker tasks (worker 0 is the chief).

    ``ps=0`` is all-reduce training (no parameter server). At least one worker is needed:
    a cluster of 0 tasks, or of ps tasks only, has nobody to train and is refused.
    """

    ps: int
    workers: int

    def __post_init__(self) -> None:
        for name in ("ps", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ClusterConfigError(
                    f"the number of {name} tasks must be a non-negative integer, got {show(value)}"
                )
        if self.ps + self.workers == 0:
            raise ClusterConfigError(
                "the cluster shape has 0 tasks (0 ps, 0 workers): there is nothing to run. "
                "Give at least one worker, e.g. --ps 1 --workers 2"
            )
        if self.workers == 0:
            raise ClusterConfigError(
                f"the cluster shape has {self.ps} ps tasks but 0 workers: nobody would train "
                "and the ps tasks would wait for the chief forever. Give at least one worker, "
                "e.g. --workers 2"
            )

    @property
    def num_tasks(self) -> int:
        """``ps + workers``."""
        return self.ps + self.workers

    @property
    def tasks(self) -> list[TaskId]:
        """Every task, ps first (Slurm's rank order and the launcher's)."""
        return [TaskId("ps", i) for i in range(self.ps)] + [
            TaskId("worker", i) for i in range(self.workers)
        ]

    def __str__(self) -> str:
        return f"{self.ps} ps + {self.workers} workers"
