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

Every engine refuses, when the session starts (its ``wrap``), a model holding a
``tfl.EmbeddingTable``: the engines run copies or slices of the model in threads of their
own, and a table's rows are reached only through the session's attachment of the table
object itself (a replica's deep copy is never attached). A model with an engine and an
active :class:`~tensorfleet.worker.push_overlap.Overlap` is told (a log line) that the
engine turns the overlap off: its own backward pass fires no gradient hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from tensorfleet.errors import ConfigError, ConfigTypeError
from tensorfleet.parallel.engine_updaters import LocalPipelineUpdater, ReplicaUpdater
from tensorfleet.parallel.pipeline_updater import (
    PipelineCluster,
    PipelineLeaderUpdater,
    pipeline_stage_of,
)
from tensorfleet.parallel.stages import check_microbatches
from tensorfleet.session.server import Server
from tensorfleet.worker.table_attachment import find_tables

if TYPE_CHECKING:
    from tensorfleet.session.update_modes import UpdateSettings
    from tensorfleet.worker.push_overlap import Overlap
    from tensorfleet.worker.updater import Updater

log = logging.getLogger("tensorfleet.session")


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
    _say_overlap_is_off(wanted[0].name, server, getattr(updater, "overlap", None))
    return wanted[0].wrap(updater, server, settings)


def device_option(
    option: str, devices: Sequence[str] | int | None, *, count_ok: bool
) -> tuple[str, ...] | None:
    """The device list of the session option ``option`` (``replica_devices``,
    ``stage_devices``) as a tuple of device strings; with ``count_ok``, an int ``n`` means
    ``n`` CPU devices ``/cpu:0`` .. ``/cpu:n-1`` (as ``tfl.InGraphReplicas(model, n)``).
    A single string (most likely a missing list) and other types are refused, naming the
    value and the fix."""
    if devices is None:
        return None
    example = "['/cpu:0', '/cpu:1']"
    if isinstance(devices, int) and not isinstance(devices, bool) and count_ok:
        if devices < 1:
            raise ConfigError(
                f"{option}={devices}: a count of CPU replicas must be >= 1; e.g. "
                f"{option}=2 (the devices /cpu:0 and /cpu:1), or a list such as {example}"
            )
        return tuple(f"/cpu:{index}" for index in range(devices))
    if isinstance(devices, str):
        raise ConfigError(
            f"{option}={devices!r} is one string; {option} takes a list of device strings, "
            f"one per {'replica' if count_ok else 'stage'}: e.g. {option}={example}"
        )
    if isinstance(devices, bool) or not isinstance(devices, Sequence):
        counts = " or a count of CPU replicas (an int)" if count_ok else ""
        raise ConfigTypeError(
            f"{option} takes a list of device strings{counts}, got "
            f"{type(devices).__name__} {devices!r}: e.g. {option}={example}"
        )
    return tuple(devices)


def refuse_embedding_tables(model: nn.Module, engine: str) -> None:
    """ConfigError when ``model`` holds a ``tfl.EmbeddingTable``, naming each table's place
    in the model, the ``engine`` and the fixes: the engines run copies or slices of the model
    in threads of their own, which the table's attachment to the ps rows does not reach."""
    tables = find_tables(model)
    if not tables:
        return
    places = ", ".join(repr(place or "(the model itself)") for place, _ in tables)
    raise ConfigError(
        f"the model holds tfl.EmbeddingTable modules ({places}), which the device engine "
        f"{engine!r} ({_ENGINE_OPTIONS.get(engine, engine)}) cannot run: its replicas or "
        "stages would use tables that are not attached to their rows. Fix: build the "
        "embedding as nn.Embedding(..., sparse=True) (the ps holds it as rows too, and it "
        "works with replica_devices), or train without a device engine"
    )


class _RefusesTables:
    """Mixed into an engine's updater: its ``wrap`` first refuses a model holding tables."""

    engine_name = ""

    def wrap(self, model: nn.Module) -> nn.Module:
        refuse_embedding_tables(model, self.engine_name)
        return super().wrap(model)  # type: ignore[misc,no-any-return]


class _Replicas(_RefusesTables, ReplicaUpdater):
    engine_name = "replicas"


class _LocalPipeline(_RefusesTables, LocalPipelineUpdater):
    engine_name = "local_pipeline"


class _TaskPipeline(_RefusesTables, PipelineLeaderUpdater):
    engine_name = "task_pipeline"


#: What a user writes to ask for each engine (for the messages).
_ENGINE_OPTIONS = {
    "replicas": "replica_devices=",
    "local_pipeline": "stage_devices=",
    "task_pipeline": "pipelines across tasks, --pipeline-stages",
}


def _say_overlap_is_off(engine: str, server: Server | None, overlap: Overlap | None) -> None:
    """Log that ``engine`` turns off ``overlap``, the one the mode's updater would apply
    (None where it applies none: sync, ``max_staleness``, all-reduce): a warning when
    prefetch was asked for, an info line for the buckets alone (on by default)."""
    if server is None or overlap is None:
        return
    asked = [
        *([f"buckets (bucket_bytes={overlap.bucket_bytes})"] if overlap.bucket_bytes else []),
        *(["prefetch"] if overlap.prefetch else []),
    ]
    log.log(
        logging.WARNING if overlap.prefetch else logging.INFO,
        "%s: the overlap asked for (%s) is off with the device engine %r (%s): it runs its own "
        "backward pass, which fires no gradient hooks, so each step pushes once per shard "
        "after it and waits for the replies; pass overlap=None to silence this",
        server.task,
        " and ".join(asked),
        engine,
        _ENGINE_OPTIONS.get(engine, engine),
    )


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
    return _Replicas(
        updater, list(settings.replica_devices or ()), soft_placement=settings.soft_placement
    )


def _local_pipeline(updater: Any, server: Server | None, settings: UpdateSettings) -> Any:
    return _LocalPipeline(
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
    return _TaskPipeline(
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
