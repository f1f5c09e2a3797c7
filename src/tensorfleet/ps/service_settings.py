"""The settings of a parameter-server shard, in one validated place.

:class:`ServiceSettings` holds the shard's timeouts and message limits, their defaults and
their checks. Every way of configuring a ps starts from it: the service's own
:class:`ServiceConfig` (these settings plus the shard's index and the cluster's workers; also
importable from :mod:`tensorfleet.ps.service`), the user-facing ``ServerConfig`` of :mod:`tensorfleet.session.server`
(which extends it), and the defaults of ``tensorfleet server``'s flags. It imports neither
torch nor ZeroMQ, so the command line can read its defaults cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from tensorfleet.errors import ConfigError
from tensorfleet.wire.message import Limits


@dataclass(frozen=True)
class ServiceSettings:
    """Timeouts and limits of one ps shard (checked on construction: :class:`ConfigError`)."""

    idle_timeout_s: float = 1800.0
    """End (with an error) when no valid request arrived for this long."""
    end_grace_s: float = 60.0
    """After the chief's ``end``, how long to wait for the other workers' ``done``."""
    liveness_timeout_s: float = 15.0
    """A worker not heard from (requests or heartbeats) for this long is lost."""
    limits: Limits = Limits()
    """Message size and count limits the shard enforces."""
    max_memory: int | None = None
    """Most bytes the shard's embedding tables may take (counted at their full size); a
    table that would not fit is refused at creation. None: no limit."""
    preempt_grace_s: float = 10.0
    """After a preemption notice (SIGTERM), how long the shard keeps serving while it waits
    for each model's chief to write a checkpoint, before it exits with status 143
    (:mod:`tensorfleet.ps.preemption_drain`)."""
    update_log_dir: str | None = None
    """Where the shard logs every update it applies since its newest checkpoint, so that a
    restore after its process was killed replays them (:mod:`tensorfleet.ps.update_log`).
    None: no log (a killed shard comes back at its newest checkpoint)."""
    update_log_snapshot_bytes: int | None = None
    """With an update log: once the updates logged since the newest checkpoint or snapshot
    hold this many bytes, the shard writes a snapshot of its dense state to the log and
    deletes the segments before it, which bounds the log's size and a restore's replay
    (:mod:`tensorfleet.ps.update_log`, "Snapshots"). None: the default,
    :func:`~tensorfleet.ps.update_log.snapshot_after_bytes`; 0: never (the log grows until
    the next checkpoint)."""

    def __post_init__(self) -> None:
        if not (
            self.idle_timeout_s > 0
            and self.liveness_timeout_s > 0
            and self.end_grace_s >= 0
            and self.preempt_grace_s >= 0
        ):
            raise ConfigError(
                "idle_timeout_s and liveness_timeout_s must be > 0, end_grace_s >= 0 and "
                "preempt_grace_s >= 0, got "
                f"{self.idle_timeout_s}, {self.liveness_timeout_s}, {self.end_grace_s}, "
                f"{self.preempt_grace_s}"
            )
        if self.update_log_snapshot_bytes is not None and self.update_log_snapshot_bytes < 0:
            raise ConfigError(
                "update_log_snapshot_bytes must be >= 0 (0: never; None: the default), got "
                f"{self.update_log_snapshot_bytes}"
            )
        if self.max_memory is not None and self.max_memory <= 0:
            raise ConfigError(f"max_memory must be > 0 bytes (or None), got {self.max_memory}")

    def settings_fields(self) -> dict[str, Any]:
        """These settings as keyword arguments (of :class:`ServiceSettings` only, not of a
        subclass's own fields)."""
        return {f.name: getattr(self, f.name) for f in fields(ServiceSettings)}


@dataclass(frozen=True)
class ServiceConfig:
    """Everything one parameter-server shard is started with: which shard it is, the cluster's
    workers, and its :class:`ServiceSettings` (whose defaults and checks these fields take)."""

    shard_index: int
    """This shard's index in the ps job."""
    worker_tasks: tuple[str, ...]
    """Names of the worker tasks (``worker:0`` ...) that must say ``done`` before the ps ends."""
    idle_timeout_s: float = ServiceSettings.idle_timeout_s
    """End (with an error) when no valid request arrived for this long."""
    end_grace_s: float = ServiceSettings.end_grace_s
    """After the chief's ``end``, how long to wait for the other workers' ``done``."""
    liveness_timeout_s: float = ServiceSettings.liveness_timeout_s
    """A worker not heard from (requests or heartbeats) for this long is lost."""
    limits: Limits = ServiceSettings.limits
    max_memory: int | None = ServiceSettings.max_memory
    preempt_grace_s: float = ServiceSettings.preempt_grace_s
    """After a preemption notice, how long to wait for the chiefs' checkpoints."""
    update_log_dir: str | None = ServiceSettings.update_log_dir
    """Where the shard's update log is (None: none)."""
    update_log_snapshot_bytes: int | None = ServiceSettings.update_log_snapshot_bytes
    """When the update log writes a snapshot (None: the default; 0: never)."""
    model: str = ""
    """The model this service holds (its namespace; ``""``: the default model), and
    ``worker_tasks`` are that model's workers (:mod:`tensorfleet.ps.model_router`)."""

    @property
    def name(self) -> str:
        """``ps:0``, or ``ps:0 model 'trial-3'`` for a named model (for messages)."""
        return f"ps:{self.shard_index}" + (f" model {self.model!r}" if self.model else "")

    def __post_init__(self) -> None:
        self.settings  # noqa: B018 (checks the settings: ConfigError)

    @property
    def settings(self) -> ServiceSettings:
        """The shard's settings (timeouts and limits), checked."""
        return ServiceSettings(
            idle_timeout_s=self.idle_timeout_s,
            end_grace_s=self.end_grace_s,
            liveness_timeout_s=self.liveness_timeout_s,
            limits=self.limits,
            max_memory=self.max_memory,
            preempt_grace_s=self.preempt_grace_s,
            update_log_dir=self.update_log_dir,
            update_log_snapshot_bytes=self.update_log_snapshot_bytes,
        )

    @classmethod
    def for_shard(
        cls, shard_index: int, worker_tasks: Sequence[str], settings: ServiceSettings
    ) -> ServiceConfig:
        """The config of shard ``shard_index`` of a cluster with ``worker_tasks``, with
        ``settings`` (a :class:`ServiceSettings` or a subclass such as ``ServerConfig``)."""
        return cls(shard_index, tuple(worker_tasks), **settings.settings_fields())
