"""Pushes answered later: the sync step's contributions, and async pushes held by the
staleness gate. A mixin of :class:`~tensorfleet.ps.service.ParameterService` (it acts on the
service's store, socket, roster and counters); the step arithmetic itself is
:class:`~tensorfleet.ps.sync_aggregator.SyncAggregator`'s, the clocks
:class:`~tensorfleet.ps.staleness_gate.StalenessGate`'s.

Rule. A sync push for step t joins step t; one for an older step is answered ``dropped``,
one for a newer step is refused. When the aggregator holds enough contributions (k, or fewer
when fewer workers are left: done ones always, lost ones too under ``lost_worker='shrink'``)
their mean (clipped when ``clip_norm`` is set) is applied once and every contributor is
answered; the one whose push completed the step is told it ``made_step``. Under
``lost_worker='fail'`` a lost worker fails the waiting step, naming it. An async push that
the gate does not allow yet is held, and applied oldest first as soon as it does.

Invariant. Every push held here is answered exactly once: applied, dropped, or refused with
its reason (a lost worker, a worker that said ``done``, its deadline passed naming who is
missing or slowest); none outlives its request's deadline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorfleet.errors import ProtocolError, RemoteDeadlineExceeded, WorkerLost
from tensorfleet.ps.sync_aggregator import Contribution

if TYPE_CHECKING:
    from collections import Counter

    from tensorfleet.ps.buffer_bank import BufferBank
    from tensorfleet.ps.service_settings import ServiceConfig
    from tensorfleet.ps.staleness_gate import StalenessGate
    from tensorfleet.ps.store import VariableStore
    from tensorfleet.ps.sync_aggregator import SyncAggregator
    from tensorfleet.ps.table_requests import TableRequests
    from tensorfleet.ps.update_discipline import UpdateDiscipline
    from tensorfleet.ps.worker_roster import WorkerRoster
    from tensorfleet.wire.service_socket import Request, ServiceSocket


class SyncStepHandling:
    """The held pushes of one shard, mixed into ``ParameterService`` (see the module), which
    provides the attributes below and ``_apply_async`` / ``_answer_push`` (a push's reply)."""

    socket: ServiceSocket
    config: ServiceConfig
    store: VariableStore
    roster: WorkerRoster
    discipline: UpdateDiscipline
    aggregator: SyncAggregator | None
    gate: StalenessGate | None
    buffer_bank: BufferBank
    tables: TableRequests
    stats: Counter[str]
    global_step: int
    worker_data: dict[str, dict]
    _held: list[tuple[Request, str, list[torch.Tensor]]]

    def _release_held(self) -> None:
        """Apply every held push the staleness gate now allows, oldest first."""
        released = True
        while released:
            released = False
            for index, (request, task, gradients) in enumerate(self._held):
                if self.gate.may_apply(task):
                    del self._held[index]
                    self.gate.record(task)
                    self.tables.released(task)
                    self._apply_async(request, gradients)
                    released = True
                    break

    def _push_sync(self, request: Request, task: str, gradients: list[torch.Tensor]) -> None:
        step = request.body.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ProtocolError(
                f"a sync push needs the integer 'step' its gradients belong to, got {step!r}"
            )
        aggregator = self.aggregator
        if aggregator.is_stale(step):
            aggregator.drop(task)
            self.stats["dropped"] += 1
            self._answer_push(request, made_step=False, dropped=True)
            return
        if step > aggregator.step:
            raise ProtocolError(
                f"{task} pushed gradients for step {step}, but this shard is at step {aggregator.step}"
            )
        aggregator.add(Contribution(task, gradients, request))
        self._complete_sync_step(last_task=task)

    def _complete_sync_step(self, last_task: str | None) -> None:
        """Apply the step if enough gradients are in, and answer everyone who contributed."""
        aggregator = self.aggregator
        if not aggregator.waiting or not aggregator.is_complete(self._departed_workers()):
            return
        if last_task is None:  # a 'done' completed the step: its last contributor made it
            last_task = aggregator.waiting[-1].task
        made = aggregator.step
        mean, contributions = aggregator.take_mean()
        if self.discipline.clip_norm is not None:
            _clip_by_global_norm(mean, self.discipline.clip_norm)
        with self._logging_update(mean, aggregator.step, data=self._positions_of(contributions)):
            self.store.apply(mean)
        self.tables.step_made(made, [c.task for c in contributions])
        self.stats["pushes"] += len(contributions)
        self.global_step = aggregator.step
        for contribution in contributions:
            self._answer_push(contribution.request, made_step=contribution.task == last_task)
        self.buffer_bank.step_made(made, [c.task for c in contributions])

    def _positions_of(self, contributions: list[Contribution]) -> dict[str, dict] | None:
        """The data positions of a step's contributors, for the update log (None: none)."""
        data = {
            c.task: self.worker_data[c.task] for c in contributions if c.task in self.worker_data
        }
        return data or None

    def _departed_workers(self) -> set[str]:
        """Workers a sync step does not wait for: done, and lost when shrinking."""
        return self.roster.departed(including_lost=self.discipline.lost_worker == "shrink")

    def _fail_sync_step(self, lost: set[str]) -> None:
        names = ", ".join(sorted(lost))
        for contribution in self.aggregator.waiting:
            self.aggregator.withdraw(contribution.task)
            self.socket.fail(
                contribution.request,
                WorkerLost.code,
                f"step {self.aggregator.step} needs gradients from {names}, not heard from for "
                f"{self.config.liveness_timeout_s:g} s (dead or cut off), and lost_worker='fail'. "
                "Restart it (tensorfleet launch --max-restarts N), or train with "
                "lost_worker='shrink' or with backup workers (replicas_to_aggregate)",
            )

    def _expire_held(self, now: float) -> None:
        """Refuse the held pushes whose requester no longer waits, naming the slowest."""
        for request, task, _ in [h for h in self._held if h[0].deadline <= now]:
            self._held = [h for h in self._held if h[0] is not request]
            self.socket.fail(
                request,
                RemoteDeadlineExceeded.code,
                f"{task} is {self.gate.gap(task)} steps ahead of the slowest live worker(s) "
                f"{', '.join(self.gate.slowest())} (max_staleness={self.gate.max_staleness}) and "
                "they did not catch up in time: are they still running?",
            )

    def _expire_sync_step(self, now: float) -> None:
        """Refuse the contributions whose requester no longer waits, naming who is missing."""
        if self.aggregator is None:
            return
        expired = [c for c in self.aggregator.waiting if c.request.deadline <= now]
        # Who has not pushed, named before the expired ones withdraw (not the requester).
        missing = ", ".join(self.aggregator.missing()) if expired else ""
        for contribution in expired:
            self.aggregator.withdraw(contribution.task)
            self.socket.fail(
                contribution.request,
                RemoteDeadlineExceeded.code,
                f"step {self.aggregator.step} still waits for gradients from {missing} "
                f"({self.aggregator.needed(self._departed_workers())} of {len(self.config.worker_tasks)} needed): "
                "are they still running? Backup workers (replicas_to_aggregate < workers) let "
                "training go on without the slowest",
            )


def _clip_by_global_norm(gradients: list[torch.Tensor], max_norm: float) -> None:
    """Scale ``gradients`` in place so that their joint L2 norm is at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``'s rule)."""
    if not gradients:  # a shard without variables (only table rows)
        return
    total = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.float()) for g in gradients])
    )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in gradients:
        g.mul_(coefficient.to(g.dtype))
