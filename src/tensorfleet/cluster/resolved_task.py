"""The answer of :func:`~tensorfleet.cluster.resolver.resolve_task`: which task of which
cluster this process is (job, index, the cluster, where that came from), checked against the
cluster when made, and what follows from it (the task's rank among those that train, whether
it is the chief). A value of its own, split out of the resolver, whose role is finding it."""

from __future__ import annotations

from dataclasses import dataclass

from tensorfleet.cluster.spec import ClusterSpec, TaskId
from tensorfleet.errors import ClusterConfigError


@dataclass(frozen=True)
class ResolvedTask:
    """This process's place in the cluster, and where that knowledge came from.

    ``source`` is the :attr:`TaskDetector.name` that produced it (``"arguments"``,
    ``"flags"``, ``"TF_CONFIG"``, ``"slurm"``) so that logs and errors can say why a process
    believes it is, say, ``worker:3``. Construction checks that the task is in the cluster.
    """

    cluster: ClusterSpec
    job: str
    index: int
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, ClusterSpec):
            raise ClusterConfigError(
                f"ResolvedTask.cluster must be a ClusterSpec, got {type(self.cluster).__name__}"
            )
        if self.job not in self.cluster.jobs:
            evaluator = (
                " An evaluator is no task of a tensorfleet cluster: run it as a program of its "
                "own that evaluates each new checkpoint (tfl.checkpoints_iterator(checkpoint_dir) "
                "and tfl.load_checkpoint; docs/reliability.md, 'An evaluator')."
                if self.job == "evaluator"
                else ""
            )
            raise ClusterConfigError(
                f"{self.source}: this task is {self.job}:{self.index} but the cluster has no "
                f"job {self.job!r}; its jobs are {self.cluster.jobs}. Use one of those job "
                f"names, or add the job to the cluster.{evaluator}"
            )
        if self.index not in self.cluster.task_indices(self.job):
            raise ClusterConfigError(
                f"{self.source}: this task is {self.job}:{self.index} but job {self.job!r} has "
                f"only the task indices {self.cluster.task_indices(self.job)}. Fix the task "
                "index, or add the task to the cluster"
            )

    @property
    def task_id(self) -> TaskId:
        """``TaskId(job, index)``."""
        return TaskId(self.job, self.index)

    @property
    def address(self) -> str:
        """This task's ``"host:port"`` in the cluster."""
        return self.cluster.task_address(self.job, self.index)

    @property
    def is_chief(self) -> bool:
        """Whether this task is the chief (:meth:`ClusterSpec.chief_task`: ``chief:0`` when
        the cluster has that job, else ``worker:0``): the task that creates the variables,
        writes the checkpoints and evaluates. Known before any server starts, so a script
        can decide up front (e.g. only the chief downloads the held-out set); inside a
        session ``sess.is_chief`` says the same."""
        return self.task_id == self.cluster.chief_task()

    @property
    def num_workers(self) -> int:
        """How many tasks train the model: those of the ``"worker"`` job plus those of the
        ``"chief"`` job (which, as in TensorFlow, trains as well as leading). Shard the data
        by it with :attr:`rank`: task ``rank`` reads every ``num_workers``-th batch from
        ``rank`` on, so the workers read disjoint parts and together all of it."""
        return len(self.cluster.training_tasks())

    @property
    def rank(self) -> int | None:
        """This task's place among the tasks that train, ``0 .. num_workers - 1``, in the
        order of :meth:`ClusterSpec.training_tasks` (the chief job's first); None for a ps
        task. Unlike ``index`` it is unique when the cluster has a ``chief`` job beside the
        workers (``chief:0`` and ``worker:0`` both have index 0)."""
        tasks = self.cluster.training_tasks()
        return tasks.index(self.task_id) if self.task_id in tasks else None
