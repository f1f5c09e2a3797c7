"""Synchronous aggregation on one ps shard: for global step t, collect the gradients computed
on the step-t parameters from ``replicas_to_aggregate`` workers, apply their mean once, and
drop (and count) gradients computed on older parameters.

With ``replicas_to_aggregate`` smaller than the number of workers, the others are backup
workers: whichever k gradients arrive first make the step, the slowest are simply not waited
for. There is no token queue and no queue runner: a worker that dies takes nothing with it,
and a worker that joins late or restarts pulls the current step and contributes to it.

The mean is summed in a fixed worker order, so a run is bit-for-bit reproducible whatever
order the gradients arrive in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorfleet.errors import ConfigError


@dataclass
class Contribution:
    """One worker's gradients for the step being collected, and its waiting request."""

    task: str
    gradients: list[torch.Tensor]
    request: Any
    """The transport request to answer once the step is applied."""


@dataclass
class SyncAggregator:
    """Collects gradients per step; says when a step is complete; counts stale gradients."""

    replicas_to_aggregate: int
    worker_order: tuple[str, ...]
    """All worker task names, in the order gradients are summed."""
    step: int = 0
    """The step being collected: gradients must be computed on the parameters of this step."""
    dropped: Counter[str] = field(default_factory=Counter)
    """Stale gradients dropped, per worker."""
    _pending: dict[str, Contribution] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.replicas_to_aggregate <= len(self.worker_order):
            raise ConfigError(
                f"replicas_to_aggregate must be between 1 and the number of workers "
                f"({len(self.worker_order)}), got {self.replicas_to_aggregate}: use "
                f"replicas_to_aggregate <= {len(self.worker_order)}, or launch more workers"
            )

    def is_stale(self, step: int) -> bool:
        """Whether gradients computed on the parameters of ``step`` come too late."""
        return step < self.step

    def drop(self, task: str) -> None:
        self.dropped[task] += 1

    def add(self, contribution: Contribution) -> None:
        """Record a worker's gradients for the current step (a second push from the same
        worker for the same step, after a restart, replaces the first)."""
        self._pending[contribution.task] = contribution

    def needed(self, finished_workers: set[str]) -> int:
        """How many contributions complete the step: k, or fewer when fewer workers are left."""
        still_training = len(set(self.worker_order) - finished_workers)
        return max(1, min(self.replicas_to_aggregate, still_training))

    def is_complete(self, finished_workers: set[str]) -> bool:
        return len(self._pending) >= self.needed(finished_workers)

    @property
    def waiting(self) -> list[Contribution]:
        return list(self._pending.values())

    def missing(self) -> list[str]:
        """Workers that have not contributed to the current step."""
        return [t for t in self.worker_order if t not in self._pending]

    def withdraw(self, task: str) -> Contribution | None:
        """Remove a contribution (its requester gave up waiting)."""
        return self._pending.pop(task, None)

    def take_mean(self) -> tuple[list[torch.Tensor], list[Contribution]]:
        """The mean gradient of the step (per dtype group) and its contributions, in worker
        order; the aggregator moves on to the next step."""
        ordered = [self._pending[t] for t in self.worker_order if t in self._pending]
        mean = [g.clone() for g in ordered[0].gradients]
        for contribution in ordered[1:]:
            for total, gradient in zip(mean, contribution.gradients, strict=True):
                total.add_(gradient)
        for total in mean:
            total.div_(len(ordered))
        self._pending.clear()
        self.step += 1
        return mean, ordered
