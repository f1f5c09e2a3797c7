"""Pipelines across worker tasks inside a training session: the leader's updater and the
other stages' serving loop.

With ``S`` stages (``tensorfleet launch --pipeline-stages S``, which sets
``TENSORFLEET_PIPELINE_STAGES`` for every task), worker ``i`` is stage ``i % S`` of pipeline
``i // S`` (:func:`~tensorfleet.parallel.remote_pipeline.pipeline_layout`). Each pipeline's
leader (stage 0) runs the user's training loop in a ``TrainingSession``: its updater is a
:class:`PipelineLeaderUpdater` wrapping the mode's own updater (async, sync, ... through the
ps), so the ps sees one replica per pipeline and every mode keeps its exact meaning. The other
stages call :func:`serve_pipeline_stage` instead of training: they run their stage for the
leader until it ends training.

All workers form one torch.distributed group (rendezvous: worker 0's address, as in
``allreduce`` mode), one sub-group per pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tensorfleet.cluster.spec import ClusterSpec, TaskId
from tensorfleet.errors import UsageError
from tensorfleet.parallel.driven_pipeline import PipelineLeader, PipelinePlan, serve_stage
from tensorfleet.parallel.errors import ParallelConfigError, PipelineFailed
from tensorfleet.parallel.remote_pipeline import (
    PipelinePosition,
    join_process_group,
    pipeline_groups,
    pipeline_layout,
)
from tensorfleet.parallel.stage_exchange import StageControl
from tensorfleet.parallel.stages import stage_boundaries
from tensorfleet.worker.progress import Agreement

WORKER_JOB = "worker"


class PipelineCluster:
    """Where a worker task sits in the pipelines of its cluster."""

    def __init__(self, cluster: ClusterSpec, task: TaskId, num_stages: int) -> None:
        if task.job != WORKER_JOB:
            raise ParallelConfigError(
                f"pipeline stages are worker tasks; {task} is not one (a cluster with a 'chief' "
                "job cannot run pipelines across tasks)"
            )
        workers = cluster.num_tasks(WORKER_JOB)
        self.cluster, self.task, self.num_stages = cluster, task, num_stages
        self.world_size = workers
        self.position: PipelinePosition = pipeline_layout(workers, num_stages, task.index)
        self.stage_names = tuple(
            f"stage {s} (worker:{rank})" for s, rank in enumerate(self.position.ranks)
        )

    @property
    def is_leader(self) -> bool:
        return self.position.stage == 0

    @property
    def rendezvous_address(self) -> str:
        return self.cluster.task_address(WORKER_JOB, 0)

    def join(self, timeout_s: float) -> dist.ProcessGroup | None:
        """Join the workers' group and return this pipeline's sub-group (collective)."""
        join_process_group(
            self.rendezvous_address, self.task.index, self.world_size, timeout_s=timeout_s
        )
        return pipeline_groups(self.world_size, self.num_stages)[self.position.pipeline]


def leaders(num_workers: int, num_stages: int) -> list[int]:
    """The worker indices that lead a pipeline (the ps's replicas): 0, S, 2S, ..."""
    pipeline_layout(num_workers, num_stages, 0)
    return list(range(0, num_workers, num_stages))


class PipelineLeaderUpdater:
    """The mode's updater (``inner``) for a pipeline's leader: before each exchange the other
    stages' gradients are gathered into the model; after it, every stage gets its new values
    and the global step. Everything else is the inner updater's."""

    def __init__(
        self,
        inner: Any,
        pipeline: PipelineCluster,
        n_microbatches: int,
        *,
        timeout_s: float = 60.0,
    ) -> None:
        self.inner = inner
        self.discipline = getattr(inner, "discipline", None)
        self.collective = getattr(inner, "collective", False)
        self.pipeline = pipeline
        self.n_microbatches = n_microbatches
        self.timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = None
        self._device: torch.device | None = None
        self._leader: PipelineLeader | None = None

    def connect(self, device: torch.device | None = None) -> None:
        """The mode's connection, then the pipelines' process group (collective with the
        other stages, which join it in :func:`serve_pipeline_stage`)."""
        self.inner.connect(device)
        self._device = device
        self._group = self.pipeline.join(self.timeout_s)

    def wrap(self, model: nn.Module) -> nn.Module:
        """Cut ``model`` (balanced by parameters), tell the stages, and return the pipeline as
        the module the step closure calls."""
        if not isinstance(model, nn.Sequential):
            raise ParallelConfigError(
                "a pipeline across tasks cuts an nn.Sequential into stages; got "
                f"{type(model).__name__}: write the model as nn.Sequential(...) of its layers"
            )
        plan = PipelinePlan(
            tuple(stage_boundaries(model, self.pipeline.num_stages)),
            self.n_microbatches,
            self.pipeline.stage_names,
        )
        self._leader = PipelineLeader(model, plan, group=self._group, device=self._device)
        self._leader.configure()
        return self.inner.wrap(self._leader.module())

    def placement(self) -> dict[str, Any]:
        """What the placement report shows of this engine: the task of each layer."""
        return {"stage_tasks": self.stage_tasks()}

    def stage_tasks(self) -> dict[str, str]:
        """The task computing each layer (by module name) of the model, for the report."""
        leader = self._require()
        tasks = [name.split("(")[-1].rstrip(")") for name in leader.plan.stage_names]
        return {
            name: tasks[s]
            for s, stage in enumerate(leader.stages)
            for name, _ in stage.named_children()
        }

    def register(self, named_params: Any, rule: Any) -> None:
        self.inner.register(named_params, rule)

    def restore(self, checkpoints: Any, resume: bool = True) -> Any:
        restored = self.inner.restore(checkpoints, resume)
        self._require().send_values(StageControl(restored.global_step, False, False))
        return restored

    def pull(self) -> Any:
        progress = self.inner.pull()
        self._require().send_values(_control(progress))
        return progress

    def exchange(self, step: int, data: Any) -> Any:
        self._require().gather_gradients()
        progress = self.inner.exchange(step, data)
        self._require().send_values(_control(progress))
        return progress

    def retune(self, hyperparameters: dict[str, Any]) -> None:
        self.inner.retune(hyperparameters)

    def skip(self, step: int) -> Any:
        self._require().gather_gradients()  # the stages sent them; the update is vetoed
        progress = self.inner.skip(step)
        self._require().send_values(_control(progress))
        return progress

    def agree(self, stop: bool, checkpoint: bool = False, preempted: bool = False) -> Agreement:
        return self.inner.agree(stop, checkpoint, preempted)

    def save(self, data: Any = None, tables_since: Any = None) -> Any:
        return self.inner.save(data, tables_since)

    def finish(self, before_done: Callable[[], object] | None, failed: bool = False) -> None:
        try:
            self.inner.finish(before_done, failed)
        finally:
            if self._leader is not None:
                try:
                    self._leader.end()
                except PipelineFailed:
                    if not failed:
                        raise

    def leave(self) -> None:
        """The ps shards are told; the pipeline's stages notice the leader's end at their
        next exchange and fail with a message naming it."""
        self.inner.leave()

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def stats(self) -> list[dict[str, Any]]:
        return self.inner.stats()

    def moving_average(self) -> dict[str, torch.Tensor]:
        return self.inner.moving_average()

    def _require(self) -> PipelineLeader:
        if self._leader is None:
            raise UsageError("connect() and wrap() the pipeline leader's updater first")
        return self._leader


def serve_pipeline_stage(
    server: Any,
    model: nn.Sequential,
    *,
    device: torch.device | None = None,
    timeout_s: float = 60.0,
) -> int:
    """Run this worker's stage of its pipeline until the leader ends training; the number of
    steps served. For the workers that are not a pipeline's stage 0: ``server`` is this task's
    :class:`~tensorfleet.session.server.Server` (its cluster, task and ``pipeline_stages``),
    ``model`` the same model the leader builds (its values come from the leader)."""
    pipeline = PipelineCluster(server.cluster, server.task, server.pipeline_stages)
    if pipeline.num_stages < 2:
        raise ParallelConfigError(
            f"{server.task} runs no pipeline (pipeline_stages is 1): launch with "
            "--pipeline-stages S, or set TENSORFLEET_PIPELINE_STAGES on every task"
        )
    if pipeline.is_leader:
        raise ParallelConfigError(
            f"{server.task} leads pipeline {pipeline.position.pipeline}: it trains with a "
            "TrainingSession; serve_pipeline_stage is for the other stages"
        )
    group = pipeline.join(timeout_s)
    try:
        return serve_stage(
            model, pipeline.position.stage, pipeline.stage_names, group=group, device=device
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def pipeline_stage_of(server: Any) -> int:
    """This worker's stage in its pipeline (0: it leads and trains; 0 too without pipelines)."""
    if server.pipeline_stages < 2 or server.task.job != WORKER_JOB:
        return 0
    return server.task.index % server.pipeline_stages


def _control(progress: Any) -> StageControl:
    return StageControl(int(progress.global_step), bool(progress.stop), bool(progress.made_step))
