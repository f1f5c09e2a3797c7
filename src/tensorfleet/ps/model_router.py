"""``ModelRouter``: one ps task serving several models, each in its own namespace.

The router owns the task's socket and its request loop. Each request names its model
(``model`` in the body; none: the default model ``""``), and the router hands it to that
model's own :class:`~tensorfleet.ps.service.ParameterService`, which has its own variables,
update rule, global step, worker roster, sync step, staleness gate and end of training. A
cluster that names no model has one model, the default, and behaves exactly as a single
``ParameterService`` (the same requests, replies and end).

The rules:

* **A model is opened by a hello** naming it; its workers are those the hello declares
  (``model_workers``; none declared: every worker of the cluster). Any other request for a
  model this ps does not hold is refused with :class:`~tensorfleet.errors.NotInitialized`
  (the client then says hello again, as after a ps restart). A later hello claiming the
  model for other workers or another variable layout is refused
  (:meth:`ModelClaim.check_same_training <tensorfleet.ps.model_namespace.ModelClaim.check_same_training>`).
* **Each model ends on its own**, by its service's rule (every one of *its* workers done,
  or its chief's end plus grace): a model never waits for another model's workers. An
  ended model still answers its own workers (late heartbeats, a ``done``), but a hello from
  a new process for it is refused: a new training needs a new name.
* **The ps task ends** when every model it opened is over and every worker of the cluster
  belonged to one of them; if some workers never trained any model here, ``end_grace_s``
  after the last model ended (a warning names them). A default model nobody said hello to
  does not exist, so it holds nothing. ``idle_timeout_s`` without a valid request ends the
  task as before, and so does ``stop``.
* **Operations between models** (``copy_model``, ``set_hyperparameters``, and a
  controller's ``hello`` that opens no model) are the router's own, answered between two
  requests of the loop (:mod:`tensorfleet.ps.namespace_copy`).
"""

from __future__ import annotations

import logging
import threading
import time

from tensorfleet.errors import (
    NotInitialized,
    ProtocolError,
    RemoteError,
    RemoteProtocolError,
    RequestRefused,
)
from tensorfleet.ps import namespace_copy
from tensorfleet.ps.model_namespace import DEFAULT_MODEL, ModelClaim, check_model_name, label
from tensorfleet.ps.preemption_drain import PreemptionDrain
from tensorfleet.ps.service import ParameterService, ServiceConfig, ServiceOutcome, refusal_code
from tensorfleet.ps.spans import NO_SPANS, SpanRecorder
from tensorfleet.wire.service_socket import Request, ServiceSocket

log = logging.getLogger("tensorfleet.ps")

#: How many models one ps task holds at most (each is a service with its own state).
MAX_MODELS = 1024


class ModelRouter:
    """The request loop of one ps task: one :class:`ParameterService` per model."""

    def __init__(
        self, socket: ServiceSocket, config: ServiceConfig, spans: SpanRecorder = NO_SPANS
    ) -> None:
        self.socket = socket
        self.config = config
        self.spans = spans
        """Where the task records receiving each request and its models' updates and
        replies (a timeline: :mod:`tensorfleet.ps.spans`)."""
        self.models: dict[str, ParameterService] = {}
        self.claims: dict[str, ModelClaim] = {}
        self.over: dict[str, str] = {}
        """The models whose training is over, and why (``finished`` or ``ended``)."""
        self._all_over_since: float | None = None
        self._drain: PreemptionDrain | None = None

    @property
    def name(self) -> str:
        return f"ps:{self.config.shard_index}"

    def serve(
        self, stop: threading.Event | None = None, preempt: threading.Event | None = None
    ) -> ServiceOutcome:
        """Run the request loop until every model's training is over, ``stop`` is set, or
        ``preempt`` is set and the task is drained (:mod:`tensorfleet.ps.preemption_drain`:
        the outcome is then ``preempted``). Every model's update log is closed when it ends
        (the space allocated ahead of its records given back)."""
        try:
            return self._serve(stop, preempt)
        finally:
            for service in self.models.values():
                service.close_update_log()

    def _serve(
        self, stop: threading.Event | None, preempt: threading.Event | None
    ) -> ServiceOutcome:
        while True:
            reason = self._finished_reason(stop) or self._preempted(preempt)
            if reason is not None:
                steps = {name: service.global_step for name, service in self.models.items()}
                default = self.models.get(DEFAULT_MODEL)
                step = (
                    default.global_step if default is not None else max(steps.values(), default=0)
                )
                progress = default.where_training_is() if default is not None else ""
                return ServiceOutcome(reason, step, models=steps, progress=progress)
            if self.socket.poll(0.2):
                with self.spans.span("receive"):  # reading, verifying, mapping the payload
                    request = self.socket.receive()
                if request is not None:
                    self.route(request)
            for model, service in self.models.items():
                if model in self.over:
                    continue
                service.housekeeping()
                over = service.training_over()
                if over is not None:
                    self.over[model] = over
                    log.info(
                        "%s: training over (%s) %s",
                        service.config.name,
                        over,
                        service.where_training_is(),
                    )
                    for line in service.tables.stat_lines():  # each table's final numbers
                        log.info("%s: %s", service.config.name, line)

    def route(self, request: Request) -> None:
        """Hand ``request`` to its model's service (opening the model on a hello)."""
        if namespace_copy.answers(request):  # between models: the router's own
            self._answer_between_models(request)
            return
        model = request.body.get("model", DEFAULT_MODEL)
        try:
            check_model_name(model)
            service = self._service_for(model, request)
        except (RequestRefused, NotInitialized) as exc:
            self.socket.fail(request, exc.code, str(exc))
            return
        except (ProtocolError, ValueError) as exc:  # a malformed name or claim
            self.socket.fail(request, RemoteProtocolError.code, str(exc))
            return
        service.handle(request)

    def _answer_between_models(self, request: Request) -> None:
        """``copy_model`` and ``set_hyperparameters`` (:mod:`tensorfleet.ps.namespace_copy`):
        answered here, between two requests of the loop, so that no push sees half of one."""
        try:
            with self.spans.span("apply", task=str(request.body.get("task"))):
                body = namespace_copy.answer(self.models, request)
        except (RemoteError, ProtocolError, ValueError) as exc:
            self.socket.fail(request, refusal_code(exc), str(exc))
            return
        self.socket.reply(request, body)

    def _service_for(self, model: str, request: Request) -> ParameterService:
        service = self.models.get(model)
        if request.op != "hello":
            if service is None:
                raise NotInitialized(
                    f"{self.name} holds no {label(model)}: none of its workers has said hello "
                    "here (a restarted ps starts empty); say hello first"
                )
            return service
        claim = ModelClaim.from_hello(request.body, self.config.worker_tasks)
        task = request.body.get("task")
        if service is None:
            return self._open(claim)
        known = self.claims[model]
        known.check_same_training(claim, self.name, task)
        self.claims[model] = ModelClaim(
            model,
            known.workers if known.workers is not None else claim.workers,
            known.layout_sha256 or claim.layout_sha256,
            known.layout_summary or claim.layout_summary,
        )
        if model in self.over and service.roster.holders.get(task) != request.body.get("instance"):
            raise RequestRefused(
                f"{self.name}: the training of {label(model)} is over ({self.over[model]} at "
                f"global step {service.global_step}); {task} is a new process: a new training "
                "needs its own model_name"
            )
        return service

    def _open(self, claim: ModelClaim) -> ParameterService:
        if len(self.models) >= MAX_MODELS:
            raise RequestRefused(
                f"{self.name} holds {len(self.models)} models already (the most it holds): "
                "finish some trainings, or add ps tasks"
            )
        workers = claim.workers if claim.workers is not None else self.config.worker_tasks
        config = ServiceConfig(
            self.config.shard_index,
            tuple(workers),
            idle_timeout_s=self.config.idle_timeout_s,
            end_grace_s=self.config.end_grace_s,
            liveness_timeout_s=self.config.liveness_timeout_s,
            limits=self.config.limits,
            max_memory=self.config.max_memory,
            preempt_grace_s=self.config.preempt_grace_s,
            update_log_dir=self.config.update_log_dir,
            update_log_snapshot_bytes=self.config.update_log_snapshot_bytes,
            model=claim.name,
        )
        service = ParameterService(self.socket, config)
        service.spans = self.spans
        self.models[claim.name] = service
        self.claims[claim.name] = claim
        if claim.name != DEFAULT_MODEL or claim.workers is not None:
            log.info("%s: opened for %s", config.name, ", ".join(config.worker_tasks))
        return service

    def _preempted(self, preempt: threading.Event | None) -> str | None:
        """``preempted`` once a preemption notice came and every model is drained."""
        if preempt is None or not preempt.is_set():
            return None
        if self._drain is None:
            self._drain = PreemptionDrain(time.monotonic(), self.config.preempt_grace_s, self.name)
            self._drain.start(self.models)
        for service in self.models.values():  # a model opened meanwhile is asked too
            service.checkpoint_wanted = True
        return "preempted" if self._drain.drained(self.models) else None

    def _finished_reason(self, stop: threading.Event | None) -> str | None:
        now = time.monotonic()
        if stop is not None and stop.is_set():
            return "stopped"
        if self.models and len(self.over) == len(self.models):
            covered = {w for service in self.models.values() for w in service.config.worker_tasks}
            missing = [w for w in self.config.worker_tasks if w not in covered]
            ended = "ended" if "ended" in self.over.values() else "finished"
            if not missing:
                return ended
            if self._all_over_since is None:
                self._all_over_since = now
            if now - self._all_over_since >= self.config.end_grace_s:
                log.warning(
                    "%s: ending %.0f s after the last model's training ended; %s trained no "
                    "model here",
                    self.name,
                    self.config.end_grace_s,
                    ", ".join(missing),
                )
                return "ended"
        else:
            self._all_over_since = None
        if now - self.socket.last_valid_request_time > self.config.idle_timeout_s:
            log.error(
                "%s: no valid request from any worker for %.0f s; ending. Workers may have died, "
                "or they use another cluster secret (rejected messages: %s)",
                self.name,
                self.config.idle_timeout_s,
                dict(self.socket.rejected) or "none",
            )
            return "idle"
        return None
