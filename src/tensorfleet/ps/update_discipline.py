"""How a shard applies pushes: asynchronously (optionally with bounded staleness) or
synchronously (optionally with backup workers), with optional clipping and a moving average.

The chief sends it with ``create``; every shard of a run applies the same discipline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorfleet.errors import ConfigError, ConfigTypeError, ProtocolError
from tensorfleet.ps.gradient_age import check_setting

MODES = ("async", "sync")
#: What a sync shard does when a worker stops sending heartbeats: go on with the live
#: workers (``shrink``), or refuse the step, naming the lost worker (``fail``).
LOST_WORKER_POLICIES = ("shrink", "fail")
#: The type each field must have (None aside; never a bool): the constructor checks them
#: (ConfigTypeError), and :meth:`UpdateDiscipline.from_wire` refuses others (ProtocolError),
#: so a value the wire would refuse never leaves the worker.
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "mode": (str,),
    "replicas_to_aggregate": (int,),
    "max_staleness": (int,),
    "clip_norm": (int, float),
    "ema_decay": (float,),
    "lost_worker": (str,),
    "max_gradient_age": (int, str),
}


@dataclass(frozen=True)
class UpdateDiscipline:
    """The rules a ps shard follows for incoming gradients."""

    mode: str = "async"
    """``async``: every push applied at once; ``sync``: the mean of k pushes per step."""
    replicas_to_aggregate: int | None = None
    """sync: gradients per step (default: every worker); fewer makes backup workers."""
    max_staleness: int | None = None
    """async: the fastest worker stays at most this many steps ahead of the slowest."""
    clip_norm: float | None = None
    """sync: clip the aggregated gradient to this global norm before applying it."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the variables with this decay."""
    lost_worker: str = "shrink"
    """sync: when a worker is lost (no heartbeat for the ps's liveness timeout), ``shrink``
    aggregates the live workers' gradients only; ``fail`` refuses the step naming it."""
    max_gradient_age: int | str = "auto"
    """async: a push whose gradient was computed on values more than this many updates
    behind the shard is dropped (:mod:`tensorfleet.ps.gradient_age`); ``"auto"``: 16 per
    worker, at least 64; ``"off"``: every push applied."""

    def __post_init__(self) -> None:
        for name, allowed in FIELD_TYPES.items():
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, allowed)):
                wanted = " or ".join(t.__name__ for t in allowed)
                raise ConfigTypeError(
                    f"discipline field {name}={value!r} is a {type(value).__name__}, not "
                    f"{wanted}: give {name} as {wanted}"
                )
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.replicas_to_aggregate is not None and (
            self.mode != "sync" or self.replicas_to_aggregate < 1
        ):
            raise ConfigError(
                f"replicas_to_aggregate={self.replicas_to_aggregate} needs mode 'sync' and a value >= 1"
            )
        if self.max_staleness is not None and (self.mode != "async" or self.max_staleness < 0):
            raise ConfigError(
                f"max_staleness={self.max_staleness} needs mode 'async' and a value >= 0"
            )
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ConfigError(f"clip_norm must be > 0, got {self.clip_norm}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay must be in (0, 1), got {self.ema_decay}")
        check_setting(self.max_gradient_age)
        if self.max_gradient_age != "auto" and self.mode != "async":
            raise ConfigError(
                f"max_gradient_age={self.max_gradient_age!r} needs mode 'async' (a sync step "
                "drops the gradients of an older step already)"
            )
        if self.lost_worker not in LOST_WORKER_POLICIES:
            raise ConfigError(
                f"lost_worker must be one of {LOST_WORKER_POLICIES}, got {self.lost_worker!r}"
            )

    def to_wire(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "replicas_to_aggregate": self.replicas_to_aggregate,
            "max_staleness": self.max_staleness,
            "clip_norm": self.clip_norm,
            "ema_decay": self.ema_decay,
            "lost_worker": self.lost_worker,
            "max_gradient_age": self.max_gradient_age,
        }

    @classmethod
    def from_wire(cls, data: object) -> UpdateDiscipline:
        """Parse a discipline received from the network (ProtocolError / ValueError if off)."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ProtocolError(f"'discipline' must be a map, got {type(data).__name__}")
        for key, value in data.items():
            if key not in FIELD_TYPES:
                raise ProtocolError(f"unknown discipline field {key!r}")
            allowed = FIELD_TYPES[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, allowed)):
                raise ProtocolError(f"discipline field {key}={value!r} has the wrong type")
        return cls(**{k: v for k, v in data.items() if v is not None})
