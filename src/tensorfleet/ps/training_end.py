"""The end of training on one ps shard: when its loop ends, and the ``done`` / ``end`` /
``wait_done`` operations that lead there. A mixin of
:class:`~tensorfleet.ps.service.ParameterService` (it reads the service's roster, socket and
config); who is done, lost or running is the
:class:`~tensorfleet.ps.worker_roster.WorkerRoster`'s.

Rule. Training is over (``finished``) when every worker has said ``done``, or, once the chief
has declared ``end``, when every worker is done or lost; it is over (``ended``) ``end_grace_s``
after the chief's ``end`` whoever is still missing (they are named in a warning). A shard that
has had no valid request for ``idle_timeout_s`` ends with ``idle`` (an error: its cluster is
gone or speaks with another secret). After ``end`` every reply carrying the progress (push,
pull, heartbeat) says ``stop``. A worker's ``done`` takes it out of the staleness gate (its
held push is refused) and may complete the sync step it was holding back.

Invariant. The chief's ``wait_done`` is answered exactly once: as soon as no other live
worker is running, or at its deadline with the workers still running; it never outlives its
deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tensorfleet.errors import RequestRefused

if TYPE_CHECKING:
    from collections import Counter

    import torch

    from tensorfleet.ps.gradient_age import GradientAge
    from tensorfleet.ps.service_settings import ServiceConfig
    from tensorfleet.ps.staleness_gate import StalenessGate
    from tensorfleet.ps.sync_aggregator import SyncAggregator
    from tensorfleet.ps.worker_roster import WorkerRoster
    from tensorfleet.wire.service_socket import Request, ServiceSocket

log = logging.getLogger("tensorfleet.ps")


@dataclass(frozen=True)
class ServiceOutcome:
    """Why the service loop ended."""

    reason: str
    """``finished`` (all workers done), ``ended`` (chief's end plus grace), ``idle``,
    ``stopped``, ``preempted`` (SIGTERM, then drained: :mod:`tensorfleet.ps.preemption_drain`)."""
    global_step: int
    models: dict[str, int] = field(default_factory=dict)
    """Each model's global step, by name, when a :class:`~tensorfleet.ps.model_router.ModelRouter` served."""
    progress: str = field(default="", compare=False)
    """Where training stood, in words, for the log (``TrainingEndHandling.where_training_is``:
    the pushes applied, on a shard that does not count the global step)."""

    def where(self) -> str:
        """``progress``, or ``at global step N`` where none was given."""
        return self.progress or f"at global step {self.global_step}"

    @property
    def clean(self) -> bool:
        return self.reason in ("finished", "ended", "stopped")


class TrainingEndHandling:
    """The end of training on one shard, mixed into ``ParameterService`` (see the module),
    which provides the attributes below and ``_worker_of``, ``_release_held`` and
    ``_complete_sync_step``."""

    socket: ServiceSocket
    config: ServiceConfig
    roster: WorkerRoster
    aggregator: SyncAggregator | None
    gate: StalenessGate | None
    gradient_age: GradientAge | None
    global_step: int
    owns_global_step: bool
    stats: Counter[str]
    end_declared_at: float | None
    done_workers: set[str]
    _held: list[tuple[Request, str, list[torch.Tensor]]]
    _waiting_for_done: list[Request]

    def where_training_is(self) -> str:
        """Where training stands on this shard, for a log line: the global step where this
        shard counts it (the chief's shard in async mode; every shard in sync mode), else the
        pushes it applied (another shard counts the step; this one's count stays 0)."""
        if self.owns_global_step or self.aggregator is not None:
            return f"at global step {self.global_step}"
        return (
            f"after {self.stats['pushes']} pushes applied here (another shard counts the "
            "global step)"
        )

    def _finished_reason(self, stop: threading.Event | None) -> str | None:
        if stop is not None and stop.is_set():
            return "stopped"
        return self.training_over() or self._idle_reason()

    def training_over(self) -> str | None:
        """``finished`` (every worker done, or done or lost after the chief's end), ``ended``
        (the chief's end plus ``end_grace_s``), or None while training goes on."""
        now = time.monotonic()
        if self.roster.all_done:
            return "finished"
        if self.end_declared_at is not None and self.roster.all_done_or_lost:
            return "finished"  # training is over and whoever is not done is gone
        if (
            self.end_declared_at is not None
            and now - self.end_declared_at >= self.config.end_grace_s
        ):
            missing = sorted(set(self.config.worker_tasks) - self.done_workers)
            never = [t for t in self.roster.never_heard() if t in missing]
            log.warning(
                "%s: ending %.0f s after the chief's end without 'done' from %s%s",
                self.config.name,
                self.config.end_grace_s,
                ", ".join(missing),
                f" ({', '.join(never)}: never heard from, not started or refused; messages "
                f"refused so far: {dict(self.socket.rejected) or 'none'})"
                if never
                else "",
            )
            return "ended"
        return None

    def _idle_reason(self) -> str | None:
        now = time.monotonic()
        if now - self.socket.last_valid_request_time > self.config.idle_timeout_s:
            log.error(
                "ps:%d: no valid request from any worker for %.0f s; ending. Workers may have died, "
                "or they use another cluster secret (rejected messages: %s)",
                self.config.shard_index,
                self.config.idle_timeout_s,
                dict(self.socket.rejected) or "none",
            )
            return "idle"
        return None

    def _done(self, request: Request) -> None:
        task = self._worker_of(request)
        self.roster.mark_done(task)
        self.socket.reply(request, {})
        if self.gate is not None:
            # A push of this worker still held would put it back among the live clocks.
            for held in [h for h in self._held if h[1] == task]:
                self._held.remove(held)
                self.socket.fail(
                    held[0],
                    RequestRefused.code,
                    f"{task} said it is done; its held push is dropped",
                )
            self.gate.leave(task)
            self._release_held()
        if self.aggregator is not None:
            self._complete_sync_step(last_task=None)
        self._answer_wait_done()

    def _wait_done(self, request: Request) -> None:
        """The chief waits here (after ``end``) until every other live worker that joined has
        said ``done``; at its deadline it is answered with the workers still running. A worker
        never heard from has no push to finish (it never started, or its messages are
        refused): it is named in the answer (``never_joined``), not waited for."""
        self._waiting_for_done.append(request)
        self._answer_wait_done()

    def _answer_wait_done(self, expired: bool = False) -> None:
        now = time.monotonic()
        for request in list(self._waiting_for_done):
            chief = request.body.get("task")
            never = self.roster.never_heard(exclude=chief)
            running = [t for t in self.roster.running(exclude=chief) if t not in never]
            if not running or expired and request.deadline <= now:
                self._waiting_for_done.remove(request)
                self.socket.reply(
                    request,
                    {"running": running, "never_joined": never, "global_step": self.global_step},
                )

    def _end(self, request: Request) -> None:
        if self.end_declared_at is None:
            self.end_declared_at = time.monotonic()
            log.info(
                "%s: the chief declared training over %s%s%s",
                self.config.name,
                self.where_training_is(),
                "" if self.gradient_age is None else f"; {self.gradient_age.summary()}",
                "" if self.aggregator is None else f"; {_sync_drops(self.aggregator)}",
            )
        self.socket.reply(request, {"grace_s": self.config.end_grace_s})


def _sync_drops(aggregator: SyncAggregator) -> str:
    """The sync steps' stale gradients, as the end line says them (async says its own)."""
    dropped = aggregator.dropped
    if not dropped:
        return "no gradient dropped as too late for its step"
    each = ", ".join(f"{task} {count}" for task, count in sorted(dropped.items()))
    total = sum(dropped.values())
    return f"{total} gradient{'' if total == 1 else 's'} dropped as too late for a step ({each})"
