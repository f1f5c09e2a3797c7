"""Bounded staleness (stale-synchronous parallel) for asynchronous training.

Each worker's clock is the number of its pushes applied. A push from a worker whose clock is
c may be applied only while ``c - min(clock of the live workers) <= max_staleness``: the
fastest worker is never more than ``max_staleness`` steps ahead of the slowest live one.
Its push is held (with the request's deadline) until the slowest catch up. ``max_staleness=0``
moves everyone in lockstep; no gate at all is plain asynchronous training.

Every shard receives every push of every worker in the same per-worker order, so every shard
runs the same gate on its own and no shard needs to ask another.

A worker is live from its first request until it says it is done. A worker that joins late (or
restarts) starts at the slowest live clock, so it does not hold the others back while it
"catches up" on steps it never missed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorfleet.errors import ConfigError


@dataclass
class StalenessGate:
    """Worker clocks and the rule that bounds how far apart they may drift."""

    max_staleness: int
    clocks: dict[str, int] = field(default_factory=dict)
    """Pushes applied per live worker."""
    max_gap_seen: int = 0
    """The largest ``clock - min clock`` of any push applied (never above max_staleness)."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def join(self, task: str) -> None:
        """A worker is live; it starts at the slowest live clock."""
        if task not in self.clocks:
            self.clocks[task] = min(self.clocks.values(), default=0)

    def leave(self, task: str) -> None:
        """A worker is done: it no longer holds the others back."""
        self.clocks.pop(task, None)

    def gap(self, task: str) -> int:
        """How far ``task`` is ahead of the slowest live worker."""
        self.join(task)
        return self.clocks[task] - min(self.clocks.values())

    def may_apply(self, task: str) -> bool:
        return self.gap(task) <= self.max_staleness

    def record(self, task: str) -> None:
        """A push of ``task`` was applied."""
        self.max_gap_seen = max(self.max_gap_seen, self.gap(task))
        self.clocks[task] += 1

    def slowest(self) -> list[str]:
        """The live workers with the lowest clock (those everyone may be waiting for)."""
        low = min(self.clocks.values(), default=0)
        return sorted(t for t, c in self.clocks.items() if c == low)
