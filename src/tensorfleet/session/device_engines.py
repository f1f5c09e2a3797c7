"""How a session computes each step's gradients when the model spans several devices or
tasks: in-graph replicas, a pipeline in this task, or a pipeline across tasks.

An update mode (:mod:`~tensorfleet.session.update_modes`) says how gradients become updated
parameters; a *device engine* says how they are computed, and wraps the mode's updater (so
``mode="sync"`` with in-graph replicas still means exactly sync). Like the modes, the engines
are a registry: each :class:`DeviceEngine` says when a session asks for it and how to wrap;
the session never branches on them. At most one applies.

- ``replicas``: ``TrainingSession(replica_devices=["/cpu:0", "/cpu:1"])``;
- ``local_pipeline``: ``TrainingSession(stage_devices=["/gpu:0", "/gpu:1"], microbatches=4)``;
- ``task_pipeline``: the server's ``pipeline_stages`` > 1 (``tensorfleet launch
  --pipeline-stages S``): this worker leads its pipeline (the others call
  ``tfl.serve_pipeline_stage``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorfleet.errors import ConfigError
from tensorfleet.parallel.engine_updaters import LocalPipelineUpdater, ReplicaUpdater
from tensorfleet.parallel.pipeline_updater import (
    PipelineCluster,
    PipelineLeaderUpdater,
    pipeline_stage_of,
)
from tensorfleet.parallel.stages import check_microbatches
from tensorfleet.session.server import Server

if TYPE_CHECKING:
    from tensorfleet.session.update_modes import UpdateSettings
    from tensorfleet.worker.updater import Updater


@dataclass(frozen=True)
class DeviceEngine:
    """One way to compute gradients over several devices or tasks."""

    name: str
    wanted: Callable[[Server | None, UpdateSettings], bool]
    """Whether a session with these settings on this server asks for this engine."""
    wrap: Callable[[Updater, Server | None, UpdateSettings], Updater]
    """The mode's updater wrapped (after checking the settings fit)."""


_ENGINES: dict[str, DeviceEngine] = {}


def register_device_engine(engine: DeviceEngine) -> None:
    """Make ``engine`` available to every session."""
    if engine.name in _ENGINES:
        raise ConfigError(f"device engine {engine.name!r} is registered already")
    _ENGINES[engine.name] = engine


def wanted_engines(server: Server | None, settings: UpdateSettings) -> list[str]:
    """The names of the device engines a session with ``settings`` on ``server`` asks for."""
    return [e.name for e in _ENGINES.values() if e.wanted(server, settings)]


def with_device_engine(
    updater: Updater, server: Server | None, settings: UpdateSettings
) -> Updater:
    """``updater`` wrapped by the engine the settings ask for (itself when none does)."""
    wanted = [e for e in _ENGINES.values() if e.wanted(server, settings)]
    if len(wanted) > 1:
        raise ConfigError(
            f"a session can use one of {[e.name for e in wanted]} at a time (replica_devices, "
            "stage_devices, or pipelines across tasks): pick one"
        )
    if not wanted:
        return updater
    if settings.mode == "allreduce":
        raise ConfigError(
            f"{wanted[0].name} does not combine with mode 'allreduce' (its gradients are averaged "
            "by DDP hooks during a backward these engines run themselves): use mode 'async' or "
            "'sync' with ps tasks"
        )
    check_microbatches(settings.microbatches, settings.microbatches)
    return wanted[0].wrap(updater, server, settings)


def placement_table(updater: Any, model: Any, task: str) -> str:
    """The placement report of a session's model: the ps plan of the mode's updater, and
    where the engine (if any) computes each module."""
    from tensorfleet.worker.placement_report import placement_report

    plan, shown = None, {}
    layer = updater  # the engine updaters wrap the mode's updater (``inner``)
    while layer is not None:
        plan = plan or getattr(layer, "plan", None)
        placement = getattr(layer, "placement", None)
        if callable(placement):
            shown.update(placement())
        layer = getattr(layer, "inner", None)
    return placement_report(
        model,
        plan=plan,
        task=task,
        stage_tasks=shown.get("stage_tasks"),
        replica_devices=shown.get("replica_devices"),
        stage_devices=shown.get("stage_devices"),
        stored_on=shown.get("stored_on"),
    )


def _replicas(updater: Any, server: Server | None, settings: UpdateSettings) -> Any:
    return ReplicaUpdater(
        updater, list(settings.replica_devices or ()), soft_placement=settings.soft_placement
    )


def _local_pipeline(updater: Any, server: Server | None, settings: UpdateSettings) -> Any:
    return LocalPipelineUpdater(
        updater,
        list(settings.stage_devices or ()),
        settings.microbatches,
        soft_placement=settings.soft_placement,
    )


def _task_pipeline(updater: Any, server: Server | None, settings: UpdateSettings) -> Any:
    assert server is not None
    stage = pipeline_stage_of(server)
    if stage != 0:
        raise ConfigError(
            f"{server.task} is stage {stage} of its pipeline: only stage 0 trains with a "
            "TrainingSession; call tfl.serve_pipeline_stage(server, model) on the other stages"
        )
    timeout = settings.timeouts.connect_s if settings.timeouts is not None else 60.0
    return PipelineLeaderUpdater(
        updater,
        PipelineCluster(server.cluster, server.task, server.pipeline_stages),
        settings.microbatches,
        timeout_s=timeout,
    )


register_device_engine(
    DeviceEngine("replicas", lambda server, s: s.replica_devices is not None, _replicas)
)
register_device_engine(
    DeviceEngine("local_pipeline", lambda server, s: s.stage_devices is not None, _local_pipeline)
)
register_device_engine(
    DeviceEngine(
        "task_pipeline",
        lambda server, s: server is not None and server.pipeline_stages > 1,
        _task_pipeline,
    )
)
