"""``ClientTimeouts``: every deadline of a worker's waits on the rest of the cluster, in one
validated place (the parameter-server client, the heartbeat and the all-reduce group read
them from here; the launcher's CLI takes its defaults from here)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from tensorfleet.errors import ConfigError


@dataclass(frozen=True)
class ClientTimeouts:
    """Deadlines of the worker's waits on the parameter servers, in seconds."""

    connect_s: float = 60.0
    """For every ps to answer ``hello`` (they may still be starting)."""
    initialize_s: float = 300.0
    """For the chief to create the variables (a non-chief waits this long)."""
    step_s: float = 120.0
    """For one push+pull round trip."""
    recover_s: float = 300.0
    """For a failed or restarted ps to come back (and be restored) before the worker fails."""
    heartbeat_s: float = 1.0
    """Between two heartbeats to each ps."""
    ps_silence_s: float = 10.0
    """A wait on a ps that has not answered heartbeats for this long is given up (and the
    client recovers) instead of lasting the whole step deadline."""
    finish_s: float = 120.0
    """For the chief, at the end: how long to wait for the other workers to finish."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise ConfigError(f"ClientTimeouts.{field.name} must be positive, got {value}")
