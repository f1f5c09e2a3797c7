"""The parameter-server service: one shard's request loop.

Operations (request body -> reply body [+ buffers]):

=============  ==========================================================================
``hello``      protocol and tensorfleet versions -> shard index, whether initialized
``create``     the chief's variables, update rule and initial values (idempotent)
``wait_ready`` the worker's expected variables -> held until the chief has created them
``pull``       -> current values (one buffer per dtype group), version, global step
``push``       gradients (one buffer per group) -> applied at once (async; one computed on
               values more than ``max_gradient_age`` updates old is answered ``dropped``:
               :mod:`tensorfleet.ps.gradient_age`); the reply carries the global step and,
               when asked, the new values (a push+pull in one trip)
``done``       a worker has finished
``end``        the chief declares training over; pushes are answered with ``stop``
``wait_done``  (the chief, after ``end``) -> held until every other live worker is done
``heartbeat``  a worker is alive -> global step, stop
``save``       -> the shard's state as a safetensors document (a checkpoint's shard file)
``restore``    a shard document -> the shard takes its state (``create`` can do the same)
``stats``      -> counters
=============  ==========================================================================

The loop is single-threaded: requests are applied one after another, so every push sees a
consistent shard, and nothing needs a lock. It ends when every worker has said ``done`` (or
is lost after the chief's ``end``), or ``end_grace_s`` after the chief said ``end``, or when
no worker has been heard from for ``idle_timeout_s`` (so a ps never outlives its cluster by
more than that).

The service keeps the dispatch and the operations answered at once; two roles live in
modules of their own, mixed into :class:`ParameterService`: the pushes answered later (the
sync step, pushes held by the staleness gate) in :mod:`tensorfleet.ps.sync_step`, and the end
of training (``done``, ``end``, ``wait_done``, when the loop ends) in
:mod:`tensorfleet.ps.training_end`, and the pushes of part of the variables (a bucket sent
during the worker's backward pass) in :mod:`tensorfleet.ps.partial_push`. Each states its
rule and invariant. With a timeline (``spans``, :mod:`tensorfleet.ps.spans`) the shard
records how long it applies each update and sends each reply.

Which workers are alive, lost or done, and which process holds each task's identity, is
the :class:`~tensorfleet.ps.worker_roster.WorkerRoster`'s (its docstring states the rules);
the service acts on what it reports: a lost worker no longer holds back the staleness gate,
and a sync step either goes on without it or is refused naming it (``lost_worker``). What a
save sends and what a restore must pass is :mod:`tensorfleet.ps.checkpoint_handling`'s; the
``save`` and ``restore`` requests, and the update log that brings a killed shard back to its
last acknowledged push (every applied update is logged before its reply), are
:mod:`tensorfleet.ps.save_restore`'s, a mixin too.

One service holds one model: a ps task runs one per model namespace behind
:class:`~tensorfleet.ps.model_router.ModelRouter`, which owns the socket and the loop (its
``worker_tasks`` are then that model's workers, ``model`` its name).

A refusal carries a code (:func:`~tensorfleet.errors.refusal_code`) that the client raises
as its :class:`~tensorfleet.errors.RemoteError` subclass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping

import torch

from tensorfleet import task_markers
from tensorfleet.errors import (
    ConfigError,
    IdentityInUse,
    NotInitialized,
    ProtocolError,
    RemoteError,
    RemoteProtocolError,
    refusal_code,
)
from tensorfleet.ps import checkpoint_handling
from tensorfleet.ps.buffer_bank import BufferBank
from tensorfleet.ps.gradient_age import GradientAge, read_based_on, resolve_limit
from tensorfleet.ps.layout import FusedLayout, group_tensors
from tensorfleet.ps.partial_push import PartialPushHandling
from tensorfleet.ps.pushed_hyperparameters import take_pushed
from tensorfleet.ps.save_restore import SaveRestoreHandling
from tensorfleet.ps.service_settings import ServiceConfig
from tensorfleet.ps.shard_checkpoint import ShardState, check_worker_data
from tensorfleet.ps.spans import NO_SPANS, SpanRecorder
from tensorfleet.ps.staleness_gate import StalenessGate
from tensorfleet.ps.store import VariableStore
from tensorfleet.ps.sync_aggregator import SyncAggregator
from tensorfleet.ps.sync_step import SyncStepHandling
from tensorfleet.ps.table_requests import TableRequests
from tensorfleet.ps.training_end import ServiceOutcome, TrainingEndHandling
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule, warm_up_optimizers
from tensorfleet.ps.worker_roster import WorkerRoster
from tensorfleet.task_memory import peak_rss_bytes
from tensorfleet.version import __version__
from tensorfleet.wire import value_encoding
from tensorfleet.wire.gradient_encoding import GradientDecoder
from tensorfleet.wire.message import PROTOCOL_VERSION
from tensorfleet.wire.service_socket import Request, ServiceSocket
from tensorfleet.wire.tensors import as_buffer

log = logging.getLogger("tensorfleet.ps")


def check_same_version(body: Mapping[str, object], peer: str, here: str) -> None:
    """ProtocolError unless the ``hello`` ``body`` comes from this tensorfleet version and
    protocol, naming both sides (``peer``: how to name a sender that gave no ``task``)."""
    protocol, version = body.get("protocol"), body.get("version")
    if protocol != PROTOCOL_VERSION or version != __version__:
        raise ProtocolError(
            f"version mismatch: {body.get('task', peer)} runs tensorfleet {version} "
            f"(protocol {protocol}), {here} runs {__version__} "
            f"(protocol {PROTOCOL_VERSION}); install the same tensorfleet version on every task"
        )


class ParameterService(
    SyncStepHandling, TrainingEndHandling, PartialPushHandling, SaveRestoreHandling
):
    """One ps shard: answers requests on a :class:`ServiceSocket` until training is over."""

    def __init__(self, socket: ServiceSocket, config: ServiceConfig) -> None:
        warm_up_optimizers()  # before any request is served (see its docstring)
        self.socket = socket
        self.config = config
        self.store = VariableStore()
        self.global_step = 0
        self.owns_global_step = False
        self.roster = WorkerRoster(
            config.worker_tasks, config.liveness_timeout_s, shard=config.name
        )
        self.end_declared_at: float | None = None
        self.stats: Counter[str] = Counter()
        self._waiting_for_init: list[Request] = []
        self.discipline = UpdateDiscipline()
        self.aggregator: SyncAggregator | None = None
        self.gate: StalenessGate | None = None
        self.gradient_age: GradientAge | None = None
        """async: the ages of the pushes and the bound past which one is dropped."""
        self._held: list[tuple[Request, str, list[torch.Tensor]]] = []
        """async pushes held back by the staleness gate, in arrival order."""
        self.worker_data: dict[str, dict] = {}
        """Each worker's last reported data position (saved in checkpoints)."""
        self.gradient_decoder = GradientDecoder()
        """Each worker's declared wire dtype for its gradients, and the check of each push."""
        self._waiting_for_done: list[Request] = []
        self.checkpoint_wanted = False
        """Set during a preemption (:mod:`tensorfleet.ps.preemption_drain`): every reply with
        the progress asks the chief for a checkpoint."""
        self.checkpointing_chief: str | None = None
        """The chief, when it said at ``create`` that it keeps checkpoints."""
        self.last_save_at: float | None = None
        """When a ``save`` was last answered (monotonic seconds)."""
        self.spans: SpanRecorder = NO_SPANS
        """Where the time of each update and reply is recorded (the task's timeline)."""
        self._open_update_log()
        self._handlers = {
            "hello": self._hello,
            "create": self._create,
            "wait_ready": self._wait_ready,
            "pull": self._pull,
            "push": self._push,
            "done": self._done,
            "end": self._end,
            "wait_done": self._wait_done,
            "heartbeat": self._heartbeat,
            "save": self._save,
            "restore": self._restore,
            "leave": self._leave,
            "stats": self._stats,
        }
        self.buffer_bank = BufferBank(socket, len(config.worker_tasks), self._departed_workers)
        self._handlers.update(self.buffer_bank.handlers())
        self.tables = TableRequests(
            socket, config.shard_index, config.max_memory, dense_variables=self._dense_names
        )
        self._handlers.update(self.tables.handlers())

    @property
    def done_workers(self) -> set[str]:
        """Workers that said ``done`` (the roster's)."""
        return self.roster.done

    def _dense_names(self) -> list[str]:
        """The variables this shard holds dense (none before the chief created them)."""
        return [v.name for v in self.store.layout.variables] if self.store.initialized else []

    @property
    def lost_workers(self) -> set[str]:
        """Workers not heard from for ``liveness_timeout_s`` (the roster's)."""
        return self.roster.lost

    def serve(self, stop: threading.Event | None = None) -> ServiceOutcome:
        """Run the request loop until training is over (or ``stop`` is set); the update log
        is closed when it ends (:meth:`close_update_log`)."""
        try:
            while True:
                reason = self._finished_reason(stop)
                if reason is not None:
                    progress = self.where_training_is()
                    return ServiceOutcome(reason, self.global_step, progress=progress)
                if self.socket.poll(0.2):
                    request = self.socket.receive()
                    if request is not None:
                        self.handle(request)
                self.housekeeping()
        finally:
            self.close_update_log()

    def housekeeping(self) -> None:
        """What the loop does between requests: act on lost workers, expire waits."""
        self._check_liveness()
        self._expire_waiting()

    def handle(self, request: Request) -> None:
        """Answer one request (or hold it until it can be answered)."""
        if request.op != "hello":
            try:
                self.roster.admit(request.session_id)
            except IdentityInUse as exc:  # its identity was taken over: not heard, not served
                self.stats["refused"] += 1
                self.socket.fail(request, exc.code, str(exc))
                return
            self.roster.heard_from(request.body.get("task"))
        handler = self._handlers.get(request.op)
        if handler is None:
            self.stats["unknown_op"] += 1
            self.socket.fail(
                request,
                RemoteProtocolError.code,
                f"unknown operation {request.op!r}; known: {sorted(self._handlers)}",
            )
            return
        try:
            handler(request)
        except (RemoteError, ProtocolError, ValueError) as exc:
            self.stats["refused"] += 1
            self.socket.fail(request, refusal_code(exc), str(exc))

    # -- operations ---------------------------------------------------------------------------

    def _hello(self, request: Request) -> None:
        check_same_version(request.body, "the client", f"ps:{self.config.shard_index}")
        self.roster.claim(
            request.body.get("task"),
            request.body.get("instance"),
            request.session_id,
            takeover=request.body.get("takeover") is True,
        )
        self.gradient_decoder.declare(request.body.get("task"), request.body.get("gradient_dtype"))
        self.socket.reply(
            request,
            {
                "shard": self.config.shard_index,
                "version": __version__,
                "initialized": self.store.initialized,
            },
        )

    def _create(self, request: Request) -> None:
        """Create the variables from initial values, or (``restore``: true) from a shard
        document of a checkpoint. Everything is checked before anything changes."""
        layout = FusedLayout.from_wire(request.body.get("variables"))
        task = request.body.get("task")
        saves = request.body.get("saves_checkpoints") is True and self.roster.is_worker(task)
        if self.store.initialized:
            self.checkpointing_chief = task if saves else None
            difference = layout.describe_difference(self.store.layout)
            if difference is not None:
                raise ConfigError(f"variables already created with another layout: {difference}")
            self.socket.reply(
                request,
                {
                    "created": False,
                    "global_step": self.global_step,
                    "data": self.worker_data.get(task),
                },
            )
            return
        rule = UpdateRule.from_wire(request.body.get("rule"))
        discipline = UpdateDiscipline.from_wire(request.body.get("discipline"))
        checkpoint: ShardState | None = None
        if request.body.get("restore") is True:
            checkpoint = checkpoint_handling.checked_checkpoint(
                self.config.shard_index,
                request.body,
                request.buffers,
                layout,
                UpdateRule.from_wire(request.body.get("rule")).name,
            )
            values = checkpoint_handling.group_values(layout, checkpoint)
        else:
            values = group_tensors(layout, request.buffers, "initial values")
        aggregator = gate = None
        if discipline.mode == "sync":
            aggregator = SyncAggregator(
                discipline.replicas_to_aggregate or len(self.config.worker_tasks),
                self.config.worker_tasks,
            )
        if discipline.max_staleness is not None:
            gate = StalenessGate(discipline.max_staleness)
        self.store.create(layout, rule, values)
        if discipline.ema_decay is not None:
            self.store.keep_moving_average(discipline.ema_decay)
        if checkpoint is not None:
            try:
                checkpoint_handling.restore_into(self.store, checkpoint)
            except ValueError:
                self.store = VariableStore()  # nothing of the refused create remains
                raise
        # Only now: a create that is refused (a rule torch rejects) changes nothing.
        self.aggregator, self.gate = aggregator, gate
        self.gradient_age = (
            GradientAge(
                resolve_limit(discipline.max_gradient_age, len(self.config.worker_tasks)),
                shard=self.config.name,
            )
            if discipline.mode == "async"
            else None
        )
        self.checkpointing_chief = task if saves else None
        self.tables.follow(sync=aggregator is not None, gated=gate is not None)
        self.discipline = discipline
        self.owns_global_step = request.body.get("owns_global_step") is True
        if checkpoint is not None:
            self._take_progress(request.body.get("global_step"), checkpoint)
        elif request.body.get("global_step") is not None:
            self._resume_step_of_recreated_shard(request.body.get("global_step"))
        log.info(
            "%s: %d dense variables %s (%s bytes), rule %s in torch's %s kernel (dense "
            "variables)%s",
            self.config.name,
            len(layout.variables),
            "created" if checkpoint is None else "restored (above)",
            sum(layout.group_bytes()),
            rule.name,
            self.store.kernel,
            self.tables.summary(),  # tables created later log a line each
        )
        task_markers.mark_serving(self.config.name)  # no crash loop when killed from now on
        self.socket.reply(
            request,
            {"created": True, "global_step": self.global_step, "data": self.worker_data.get(task)},
        )
        waiting, self._waiting_for_init = self._waiting_for_init, []
        for waiter in waiting:
            self.handle(waiter)

    def _wait_ready(self, request: Request) -> None:
        expected = FusedLayout.from_wire(request.body.get("variables"))
        if not self.store.initialized:
            self._waiting_for_init.append(request)
            return
        difference = expected.describe_difference(self.store.layout)
        if difference is not None:
            raise ConfigError(
                f"the model of {request.body.get('task', 'this worker')} does not match the chief's: {difference}"
            )
        self.socket.reply(
            request,
            {
                "global_step": self.global_step,
                "data": self.worker_data.get(request.body.get("task")),
            },
        )

    def _pull(self, request: Request) -> None:
        self._require_initialized()
        if request.body.get("moving_average") is True:
            values = self.store.moving_average_snapshot()
            self.socket.reply(request, self._progress(), [as_buffer(t) for t in values])
            return
        self._reply_with_values(request)

    def _push(self, request: Request) -> None:
        self._require_initialized()
        body = request.body
        take_pushed(self.store, body, self.config.name)  # a worker's schedule, if it has one
        value_encoding.requested(body)  # a dtype it cannot answer in: refused, not applied
        based_on = read_based_on(body)
        if body.get("part") is not None:
            self._push_part(request, based_on)
            return
        gradients = self.gradient_decoder.decode(
            self.store.layout.groups, body.get("task"), body.get("gradient_dtype"), request.buffers
        )
        data = request.body.get("data")
        if data is not None:
            task = self._worker_of(request)
            self.worker_data[task] = check_worker_data(task, data)
        if not self._young_enough(request, based_on):
            self._answer_push(request, made_step=False, dropped=True)
            return
        if self.aggregator is not None:
            self._push_sync(request, self._worker_of(request), gradients)
        elif self.gate is not None:
            task = self._worker_of(request)
            self.gate.join(task)
            self._held.append((request, task, gradients))
            self._release_held()
        else:
            self._apply_async(request, gradients)

    def _apply_async(self, request: Request, gradients: list[torch.Tensor]) -> None:
        counted = self.owns_global_step and request.body.get("count_step") is True
        step_after = self.global_step + (1 if counted else 0)
        with (
            self._logging_push(gradients, request.body, step_after),
            self.spans.span("apply", task=str(request.body.get("task"))),
        ):
            self.store.apply(gradients)
        self.global_step = step_after
        self.stats["pushes"] += 1
        self._answer_push(request, made_step=True)

    def _young_enough(self, request: Request, based_on: int | None) -> bool:
        """async: whether the push's gradient is recent enough to apply (counted either way;
        :mod:`tensorfleet.ps.gradient_age`). Checked after everything else about the push, so
        that a push refused for its content is refused, not dropped."""
        if self.gradient_age is None:
            return True
        task = "" if based_on is None else self._worker_of(request)  # named when it counts
        return self.gradient_age.admit(self.store.version, based_on, task)

    def _answer_push(self, request: Request, made_step: bool, dropped: bool = False) -> None:
        extra = {"made_step": made_step, "dropped": dropped}
        with self.spans.span("reply"):
            if request.body.get("want_values") is True:
                self._reply_with_values(request, extra)
            else:
                self.socket.reply(request, {**self._progress(), **extra})

    def _worker_of(self, request: Request) -> str:
        """The worker task that sent ``request`` (ProtocolError for any other name)."""
        return self.roster.worker_of(request.op, request.body.get("task"))

    def _heartbeat(self, request: Request) -> None:
        self._worker_of(request)
        self.socket.reply(request, self._progress())

    def _leave(self, request: Request) -> None:
        """A worker stops for now and will be back (it was preempted): it counts as lost at
        once, so that sync steps and the staleness bound stop waiting for it and its
        restarted process takes over its identity without waiting for the liveness timeout."""
        task = self._worker_of(request)
        self.roster.mark_left(task)
        self.socket.reply(request, {})
        self._check_liveness()

    def _check_liveness(self) -> None:
        """Act on the workers the roster found lost (or back) since the last check."""
        change = self.roster.check_liveness()
        for task in change.newly_lost:
            log.warning(
                "%s: %s %s%s",
                self.config.name,
                task,
                "left (preempted): lost until its restarted process is back"
                if task in self.roster.left
                else f"has not been heard from for {self.config.liveness_timeout_s:g} s: lost "
                "(dead, or cut off)",
                ""
                if self.aggregator is None
                else f"; sync steps {'go on without it' if self.discipline.lost_worker == 'shrink' else 'fail'}",
            )
            if self.gate is not None:
                self.gate.leave(task)
        for task in change.back:
            log.warning("%s: %s is back", self.config.name, task)
        if self.gate is not None and change.changed:
            self._release_held()
        if self.aggregator is not None and self.roster.lost:
            if self.discipline.lost_worker == "fail":
                self._fail_sync_step(self.roster.lost)
            elif change.changed:
                self._complete_sync_step(last_task=None)
        if self._waiting_for_done and change.changed:
            self._answer_wait_done()

    def _stats(self, request: Request) -> None:
        self.socket.reply(
            request,
            {
                **self._progress(),
                "pushes": self.stats["pushes"],
                "buckets": self.stats["buckets"],
                "copies_on_write": self.store.copies_on_write,
                "refused": self.stats["refused"],
                "rejected": dict(self.socket.rejected),
                "shared_memory": dict(self.socket.shared_memory),
                "streamed_replies": self.socket.streams.sent if self.socket.streams else 0,
                "streamed_requests": self.socket.streams.received if self.socket.streams else 0,
                "done_workers": sorted(self.done_workers),
                "dropped": dict(self.aggregator.dropped) if self.aggregator else {},
                "max_staleness_seen": self.gate.max_gap_seen if self.gate else None,
                "gradient_age": self.gradient_age.stats() if self.gradient_age else None,
                "mode": self.discipline.mode,
                "lost_workers": sorted(self.lost_workers),
                "tables": self.tables.stats(),
                "peak_rss_bytes": peak_rss_bytes(),
            },
        )

    # -- helpers --------------------------------------------------------------------------------

    def _progress(self) -> dict[str, object]:
        progress: dict[str, object] = {
            "global_step": self.global_step,
            "version": self.store.version,
            "stop": self.end_declared_at is not None,
        }
        if self.checkpoint_wanted:
            progress["checkpoint"] = True
        return progress

    def _reply_with_values(self, request: Request, extra: dict[str, object] | None = None) -> None:
        body = {**self._progress(), **(extra or {})}
        self._reply_from_store(request, body, self.store.live_values())

    def _reply_from_store(
        self,
        request: Request,
        body: dict[str, object],
        values: list[torch.Tensor],
        slices: list[tuple[int, int]] | None = None,
    ) -> None:
        """Reply with ``values``, the store's live tensors (or ``slices`` of its groups; None:
        whole values), without a copy: unless the socket copies them first (shared memory,
        encryption), they are lent to the reply, and the store's next write of those slices
        copies first while it is in flight. A push that asks for its values in a wire dtype
        gets them rounded (:mod:`~tensorfleet.wire.value_encoding`): new tensors, nothing
        lent."""
        asked = value_encoding.requested(request.body) if request.op == "push" else None
        if asked is not None:
            encoded = value_encoding.encode(values, asked)
            self.socket.reply(
                request, {**body, value_encoding.FIELD: asked}, [as_buffer(t) for t in encoded]
            )
            return
        tracker = self.socket.reply(request, body, [as_buffer(t) for t in values])
        if not self.socket.reply_copies_buffers(request):
            self.store.lent(tracker, slices)

    def _require_initialized(self) -> None:
        if not self.store.initialized:
            raise NotInitialized(
                f"{self.config.name} has no variables yet: the chief has not created them"
            )

    def _expire_waiting(self) -> None:
        """Give up on requests whose requester no longer waits, telling it why."""
        now = time.monotonic()
        if self._waiting_for_init:
            self._waiting_for_init = [r for r in self._waiting_for_init if r.deadline > now]
        if self._waiting_for_done:
            self._answer_wait_done(expired=True)
        self._expire_held(now)
        self._expire_sync_step(now)
