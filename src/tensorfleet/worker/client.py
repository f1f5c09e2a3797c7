"""The worker's side of the parameter servers: one channel per shard, fused buffers, every
shard in parallel, and recovery from a ps that fails or restarts at any moment.

A training step is one round trip per shard: the gradients of that shard's variables go out
as one buffer per dtype (:mod:`~tensorfleet.worker.fused_parameters`) and the new values come
back in the reply (``push`` with ``want_values``), so a step costs one latency, not two. Every
request goes through :class:`~tensorfleet.worker.shard_fanout.ShardFanout`: all shards are
sent to before any is waited on, and a wait on a shard the heartbeat reports silent or
restarted ends at once.

Failures: every operation (pull, push, save, restore, the end of training, stats, the moving
average) that fails because a ps restarted (:class:`~tensorfleet.errors.ServiceRestarted`),
went silent (:class:`~tensorfleet.errors.ConnectionLost`) or did not answer in time
(:class:`~tensorfleet.errors.DeadlineExceeded`) recovers and is tried again: the client says
hello again with back-off until every shard answers (up to ``ClientTimeouts.recover_s``); a
restarted shard that lost its variables is restored by the chief (from the newest checkpoint,
through the ``restore_shards`` callback its updater installs), and the other workers wait for
that. A push is never tried again (it could be applied twice): its step is dropped. Decisions
are made on the error's type, never on its text.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import zmq

from tensorfleet import environment
from tensorfleet.errors import (
    ConfigError,
    ConnectionLost,
    DeadlineExceeded,
    IdentityInUse,
    ProtocolError,
    TensorfleetError,
    UsageError,
)
from tensorfleet.ps.model_namespace import ModelClaim
from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.version import __version__
from tensorfleet.wire import value_encoding
from tensorfleet.wire.channel import Channel, Reply
from tensorfleet.wire.gradient_encoding import ErrorFeedback
from tensorfleet.wire.message import PROTOCOL_VERSION, Limits
from tensorfleet.worker.client_recovery import RECOVERABLE, ClientRecovery
from tensorfleet.worker.fused_parameters import FusedParameters
from tensorfleet.worker.heartbeat import Heartbeat
from tensorfleet.worker.progress import Progress
from tensorfleet.worker.shard_fanout import ANSWER_MARGIN_S, ShardFanout
from tensorfleet.worker.timeline import Timeline
from tensorfleet.worker.timeouts import ClientTimeouts

__all__ = ["ANSWER_MARGIN_S", "RECOVERABLE", "ClientTimeouts", "ParameterClient", "Progress"]

log = logging.getLogger("tensorfleet.worker")


#: How long a preempted worker tries to tell the shards it left (then they find it silent).
LEAVE_TIMEOUT_S = 5.0


class ParameterClient(ClientRecovery):
    """Pulls variables from and pushes gradients to every ps shard.

    Lifecycle: :meth:`connect`, :meth:`register` (the chief creates, the others wait for
    that), then :meth:`pull` / :meth:`push_pull` each step, and :meth:`finish`.
    Not thread-safe: one training thread owns it (the heartbeat thread has its own sockets).

    ``restore_shards`` (set by the chief's updater) is asked, when shards came back without
    their variables, for the checkpoint to bring every shard to: its global step and shard
    documents, or None when there is none (the client then re-creates those shards from the
    chief's current values).

    ``gradient_dtype`` (e.g. ``"bf16"``): float32 gradients travel in that dtype with error
    feedback (:mod:`~tensorfleet.wire.gradient_encoding`), declared in every hello and push.
    ``values_dtype`` (e.g. ``"bf16"``): the float32 values in the replies to pushes travel in
    that dtype (:mod:`~tensorfleet.wire.value_encoding`); a pull's stay exact.
    """

    def __init__(
        self,
        ps_addresses: Sequence[str],
        secret: bytes,
        task_name: str,
        timeouts: ClientTimeouts | None = None,
        limits: Limits | None = None,
        encrypt: bool = False,
        model: ModelClaim | None = None,
        gradient_dtype: str | None = None,
        values_dtype: str | None = None,
    ) -> None:
        if not ps_addresses:
            raise ConfigError("a ParameterClient needs at least one ps address, got none")
        self.task_name = task_name
        self.model = model or ModelClaim()
        """The model (namespace) this client trains: every request names it."""
        self.timeouts = timeouts or ClientTimeouts()
        self.instance = secrets.token_hex(8)
        """This process's claim to the task identity (the ps refuses a second live one)."""
        self._last_global_step = 0
        """The global step of the last reply (a shard re-created without a checkpoint takes
        it, so the global step never goes back)."""
        self._values_versions: list[int | None] = [None] * len(ps_addresses)
        """Per shard, the version of the values the model last received from it (None: none
        yet); every push names it as ``based_on`` (:mod:`tensorfleet.ps.gradient_age`)."""
        self.takeover = environment.predecessor_dead()
        """Whether the hello asks the ps to hand this process the identity at once (the
        launcher says the previous process of this task is dead)."""
        self.is_chief = False
        self.saves_checkpoints = False
        """The chief keeps checkpoints: a preempted ps waits for its checkpoint (said at
        ``create``)."""
        self.restore_shards: Callable[[], tuple[int, Sequence[bytes]] | None] | None = None
        self.recreate_tables: Callable[[Sequence[int]], None] | None = None
        """The chief's: give restarted shards (no checkpoint to restore) the tables that
        come from its values, before their variables are re-created from them."""
        self.recreate_buffers: Callable[[], None] | None = None
        """The chief's: create the model's persistent buffers again once restarted shards
        were restored or re-created (a checkpoint's values win), so that they serve them."""
        self.hyperparameters: dict[str, Any] | None = None
        """The update rule's hyperparameters every push carries (None: none, the rule's)."""
        self.restored_data: dict[str, Any] | None = None
        """This worker's data position as the ps last recorded it (None: none recorded)."""
        self._context = zmq.Context(io_threads=1)
        self._wire_fields = {"gradient_dtype": gradient_dtype} if gradient_dtype else {}
        self.values_dtype = value_encoding.check_values_wire_dtype(values_dtype)
        channels = [
            Channel(
                address, secret, f"ps:{i}", limits=limits, context=self._context, encrypt=encrypt
            )
            for i, address in enumerate(ps_addresses)
        ]
        self._heartbeat = Heartbeat(
            ps_addresses,
            secret,
            task_name,
            self.instance,
            self._context,
            interval_s=self.timeouts.heartbeat_s,
            silence_s=self.timeouts.ps_silence_s,
            encrypt=encrypt,
            model=self.model,
            hello_fields=self._wire_fields,
        )
        self._shards = ShardFanout(channels, self._heartbeat, self.model.request_fields())
        self._fused: FusedParameters | None = None
        self._encoder = ErrorFeedback(gradient_dtype) if gradient_dtype is not None else None
        self._create_bodies: list[dict[str, Any]] = []
        self._wait_bodies: list[dict[str, Any]] = []
        self._initialized: list[bool] = []
        self.global_step_at_end: int | None = None
        """The global step when every worker was done (the chief's :meth:`finish`)."""

    @property
    def num_shards(self) -> int:
        return self._shards.num_shards

    @property
    def every_shard_on_this_host(self) -> bool:
        """Whether every shard answers through shared memory (is on this host), as the
        hellos found; False before :meth:`connect`."""
        channels = self._shards.channels
        return bool(channels) and all(channel.uses_shared_memory for channel in channels)

    @property
    def _task(self) -> dict[str, str]:
        return {"task": self.task_name}

    # -- connecting and initializing ------------------------------------------------------------

    def connect(self) -> list[bool]:
        """Say hello to every shard (checks versions and the secret) and start the heartbeat.
        Returns which shards have their variables already. A shard that refuses because
        another live process holds this task's identity (:class:`IdentityInUse`) is asked
        again until ``connect_s`` has passed (the predecessor of a restarted task falls
        silent); so is a shard whose connection dropped while the hello was in flight
        (:class:`ConnectionLost`: a ps killed or restarting as this task starts, which is
        common when a cluster recovers from a fault)."""
        deadline = time.monotonic() + self.timeouts.connect_s
        delay = 0.5
        while True:
            try:
                replies = self._hello(max(1.0, deadline - time.monotonic()))
                break
            except (IdentityInUse, ConnectionLost) as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("%s: %s; asking again in %.1f s", self.task_name, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        self._heartbeat.start()
        self._initialized = [r.body.get("initialized") is True for r in replies]
        return list(self._initialized)

    def _hello(self, timeout_s: float, abort_when_silent: bool = True) -> list[Reply]:
        """Say hello to every shard; each one that answers counts as heard by the heartbeat
        (from the process that answered). ``abort_when_silent`` False: the wait is not given
        up while the heartbeat reports a shard silent (a recovery's hello, which is itself
        the question whether the ps is back: ZeroMQ delivers it the moment a restarted ps
        listens)."""
        body = {
            "protocol": PROTOCOL_VERSION,
            "version": __version__,
            "task": self.task_name,
            "instance": self.instance,
            "takeover": self.takeover,
            **self.model.hello_fields(),
            **self._wire_fields,
        }
        for channel in self._shards.channels:
            channel.forget_pending()
            channel.server_session = None
        replies = self._shards.call(
            "hello", body, timeout_s, abort_when_silent=abort_when_silent, interruptible=True
        )
        for shard, channel in enumerate(self._shards.channels):
            self._heartbeat.heard(shard, channel.server_session)
        return replies

    def register(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        plan: PlacementPlan,
        rule: UpdateRule,
        is_chief: bool,
        discipline: UpdateDiscipline | None = None,
        resume: tuple[int, Sequence[bytes]] | None = None,
    ) -> int:
        """Bind the model's parameters to the plan. The chief creates the variables with its
        current values (idempotent: if they exist already, it adopts them), or with
        ``resume`` (a checkpoint's global step and shard documents) brings every shard to
        that checkpoint; everyone else waits until the variables exist and checks that its
        model matches. Returns the global step."""
        if plan.num_shards != self.num_shards:
            raise ConfigError(
                f"placement plan for {plan.num_shards} shards, but the cluster has "
                f"{self.num_shards} ps tasks: plan for as many shards as ps tasks"
            )
        self._fused = FusedParameters(named_params, plan)
        self.is_chief = is_chief
        self._create_bodies = [
            {
                "variables": self._fused.variables(i),
                "rule": rule.to_wire(),
                "owns_global_step": i == 0,
                "discipline": (discipline or UpdateDiscipline()).to_wire(),
                "task": self.task_name,
                "saves_checkpoints": self.saves_checkpoints,
            }
            for i in range(self.num_shards)
        ]
        self._wait_bodies = [
            {"variables": self._fused.variables(i), "task": self.task_name}
            for i in range(self.num_shards)
        ]
        if is_chief and resume is not None:
            fresh = [i for i, ready in enumerate(self._initialized) if not ready]
            self.restore(resume[1], resume[0], fresh)
            replies = self._wait_ready(range(self.num_shards), self.timeouts.connect_s)
        elif is_chief:
            replies = self._create(range(self.num_shards), self.timeouts.connect_s)
            if not replies[0].body.get("created"):
                log.info("%s: variables already exist on the ps; adopting them", self.task_name)
        else:
            replies = self._wait_ready(range(self.num_shards), self.timeouts.initialize_s)
        self.restored_data = replies[0].body.get("data")
        return int(replies[0].body.get("global_step", 0))

    def _create(
        self, shards: Sequence[int], timeout_s: float, global_step: int | None = None
    ) -> list[Reply]:
        """The chief creates ``shards``' variables from its current values (a re-created
        shard also takes ``global_step``, so the global step never goes back)."""
        fused = self._bound()
        extra = {} if global_step is None else {"global_step": global_step}
        return self._shards.call(
            "create",
            [{**self._create_bodies[i], **extra} for i in shards],
            timeout_s,
            buffers=[fused.gather(i, values=True) for i in shards],
            shards=shards,
            abort_when_silent=False,  # a busy shard answers no heartbeat meanwhile
        )

    def _wait_ready(self, shards: Sequence[int], timeout_s: float) -> list[Reply]:
        shards, started = list(shards), time.monotonic()
        try:
            return self._shards.call(
                "wait_ready",
                [self._wait_bodies[i] for i in shards],
                timeout_s,
                shards=shards,
                abort_when_silent=False,  # the shard may be busy creating the variables
            )
        except DeadlineExceeded as exc:
            ended = f"within {timeout_s:.0f} s ({exc})"
            if isinstance(exc, ConnectionLost):  # a ps went away: the wait ended early
                ended = f"after {time.monotonic() - started:.0f} s, when a ps task went away: {exc}"
            raise type(exc)(
                f"{self.task_name}: the chief has not initialized the variables {ended}. Is the "
                "chief (worker 0) running? Its output, and the ps's, say why it has not."
            ) from None

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self, tables_since: Sequence[dict] | None = None) -> tuple[int, list[memoryview]]:
        """Every shard's state as a safetensors document, and the global step (shard 0's).
        ``tables_since``: per shard, ``{table: [incarnation, step]}`` to save each table as
        a delta since (:mod:`tensorfleet.ps.table_deltas`); None: in full."""
        body = self._task
        if tables_since is not None:
            body = [{**self._task, "tables_since": since} for since in tables_since]
        replies = self._recovering(lambda: self._shards.call("save", body, self.timeouts.step_s))
        documents = []
        for shard, reply in enumerate(replies):
            if len(reply.buffers) != 1:
                raise ProtocolError(
                    f"ps:{shard} answered 'save' with {len(reply.buffers)} buffers, expected 1"
                )
            documents.append(memoryview(reply.buffers[0]))  # written as received: no copy
        return int(replies[0].body.get("global_step", 0)), documents

    def restore(
        self, documents: Sequence[bytes], global_step: int, fresh: Sequence[int] = ()
    ) -> None:
        """Bring every shard to one checkpoint: shards in ``fresh`` (restarted, no variables)
        are created from their document, the others take it over their current state; all
        of them take ``global_step``. A ps that restarts meanwhile is recovered, and the
        restore tried again."""
        if len(documents) != self.num_shards:
            raise ConfigError(
                f"{len(documents)} shard documents for {self.num_shards} ps tasks: restore a "
                "checkpoint of as many shards as ps tasks"
            )
        first = True

        def attempt() -> None:
            nonlocal first
            # After a recovery every shard has its variables again (the chief restored or
            # re-created them): from then on they all take the documents over their state.
            creating, first = (fresh if first else ()), False
            self._restore_now(documents, global_step, creating)

        self._recovering(attempt)

    def _restore_now(
        self, documents: Sequence[bytes], global_step: int, fresh: Sequence[int]
    ) -> int:
        """Restore every shard (``fresh`` ones created from their document); the global step
        they answer with (past ``global_step`` when a shard's update log replayed since)."""
        ops = ["create" if shard in fresh else "restore" for shard in range(self.num_shards)]
        bodies = [
            {**self._create_bodies[shard], "restore": True, "global_step": global_step}
            if op == "create"
            else {"task": self.task_name, "global_step": global_step}
            for shard, op in enumerate(ops)
        ]
        replies = self._shards.call(
            ops,
            bodies,
            self.timeouts.step_s,
            buffers=[[document] for document in documents],
            abort_when_silent=False,  # a shard restoring its state answers nothing else
        )
        step = replies[0].body.get("global_step")  # shard 0 counts the global step
        return step if isinstance(step, int) else global_step

    # -- training -------------------------------------------------------------------------------

    def pull(self) -> Progress:
        """Bring the current values of every variable into the model (recovering first if a
        ps fails on the way)."""
        replies = self._recovering(
            lambda: self._shards.call("pull", self._task, self.timeouts.step_s)
        )
        self._scatter(replies)
        return self._progress(replies)

    def push_pull(
        self,
        count_step: bool = True,
        step: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> Progress:
        """Send the model's gradients to every shard and bring the values returned into the
        model: one round trip per shard, all shards at once. ``data`` (this worker's data
        position after the batch of these gradients) goes to shard 0, which keeps it for
        checkpoints. When a ps fails during the exchange the step is dropped (never sent
        twice), the client recovers and pulls, and the progress says ``recovered``."""
        fused = self._bound()
        bodies = [
            {
                "count_step": count_step and i == 0,
                "want_values": True,
                "task": self.task_name,
                "step": step,
                **self.push_fields(),
                **self.based_on(i),
                **({"data": data} if data is not None and i == 0 else {}),
            }
            for i in range(self.num_shards)
        ]
        with self._shards.timeline.span("pack"):
            buffers = self._gradient_buffers(fused)
        try:
            replies = self._shards.call("push", bodies, self.timeouts.step_s, buffers=buffers)
        except RECOVERABLE as exc:
            self.recover(exc)
            progress = self.pull()
            return Progress(
                progress.global_step, progress.stop, made_step=False, dropped=True, recovered=True
            )
        self._scatter(replies, pushed=True)
        return self._progress(replies)

    def based_on(self, shard: int) -> dict[str, int]:
        """What a push to ``shard`` names of the values its gradient was computed on: their
        version, as ``based_on`` (nothing before the model received any)."""
        version = self._values_versions[shard]
        return {} if version is None else {"based_on": version}

    def push_fields(self) -> dict[str, Any]:
        """What every push names of how it travels (its gradients' and its values' dtypes)
        and, once the session's schedule changed them, the rule's hyperparameters."""
        fields = {**self._wire_fields, **value_encoding.request_fields(self.values_dtype)}
        if self.hyperparameters is not None:
            fields["hyperparameters"] = self.hyperparameters
        return fields

    def moving_average(self) -> dict[str, torch.Tensor]:
        """The moving average the shards keep, as fresh tensors by parameter name."""
        replies = self._recovering(
            lambda: self._shards.call("pull", {"moving_average": True}, self.timeouts.step_s)
        )
        return self._bound().assemble([reply.buffers for reply in replies])

    def wire_bytes(self) -> tuple[int, int]:
        """Bytes this client sent to and received from its shards so far (requests and
        replies, payloads included: :attr:`Channel.bytes_sent`), heartbeats excluded."""
        channels = self._shards.channels
        return sum(c.bytes_sent for c in channels), sum(c.bytes_received for c in channels)

    def stats(self) -> list[dict]:
        """Each shard's counters (pushes, rejected messages, ...)."""
        replies = self._recovering(lambda: self._shards.call("stats", {}, self.timeouts.connect_s))
        return [r.body for r in replies]

    # -- the end --------------------------------------------------------------------------------

    def finish(
        self, declare_end: bool, before_done: Callable[[], object] | None = None
    ) -> list[str]:
        """Tell every shard this worker is done. The chief first declares training over, waits
        (up to ``finish_s``, within the ps's grace period) until every other live worker is
        done, and runs ``before_done`` (the final checkpoint) while the shards still serve.
        Returns the workers still running when the chief stopped waiting. A ps that restarts
        meanwhile is recovered and the step that failed tried again."""
        running: list[str] = []
        if declare_end:
            replies = self._recovering(
                lambda: self._shards.call("end", self._task, self.timeouts.connect_s)
            )
            grace = min(float(r.body.get("grace_s", 60.0)) for r in replies)
            wait_s = max(0.5, min(self.timeouts.finish_s, grace - 10.0))

            first = True

            def wait_done() -> list[Reply]:
                nonlocal first
                if not first:  # a restarted ps has forgotten that training ended: say it again
                    self._shards.call("end", self._task, self.timeouts.connect_s)
                first = False
                return self._shards.call("wait_done", self._task, wait_s)

            replies = self._recovering(wait_done)
            running = sorted({t for r in replies for t in r.body.get("running", [])})
            step = replies[0].body.get("global_step")  # shard 0 counts the global step
            self.global_step_at_end = step if isinstance(step, int) else None
            never = sorted({t for r in replies for t in r.body.get("never_joined", [])})
            if running:
                log.warning(
                    "%s: %s still running %.0f s after the end of training; not waiting longer",
                    self.task_name,
                    ", ".join(running),
                    wait_s,
                )
            if never:
                log.warning(
                    "%s: %s never reached the parameter servers (not started, or its messages "
                    "were refused: another secret? the ps's log counts refused messages); not "
                    "waiting for it",
                    self.task_name,
                    ", ".join(never),
                )
            if before_done is not None:
                before_done()
        # A worker that only says it is done needs no variables on a restarted ps.
        self._recovering(
            lambda: self._shards.call("done", self._task, self.timeouts.connect_s),
            reinitialize=self.is_chief,
        )
        return running

    def leave(self) -> None:
        """Tell every shard this worker left for now (preempted, to be restarted; not done):
        it counts as lost at once. The heartbeat stops first, so that nothing says it is
        alive afterwards. A shard that cannot be told within :data:`LEAVE_TIMEOUT_S` (a
        preemption's grace period is short) is logged, not raised: it will find the worker
        silent."""
        self._heartbeat.stop()
        ending = self._shards.draining()  # preempted shards: they end now
        shards = [k for k in range(self.num_shards) if k not in ending]
        if not shards:  # every shard ends after the checkpoint it asked for: none to tell
            return
        try:
            self._shards.call(
                "leave", self._task, min(LEAVE_TIMEOUT_S, self.timeouts.connect_s), shards=shards
            )
        except TensorfleetError as exc:
            log.warning("%s: could not tell every ps that it left: %s", self.task_name, exc)

    def close(self) -> None:
        self._heartbeat.stop()
        for channel in self._shards.channels:
            channel.close()
        self._context.term()

    # -- internals ------------------------------------------------------------------------------

    def _bound(self) -> FusedParameters:
        if self._fused is None:
            raise UsageError("register() the model's parameters with the client first")
        return self._fused

    def _gradient_buffers(self, fused: FusedParameters) -> list[list[memoryview]]:
        channels = self._shards.channels
        return [
            fused.pack_gradients(shard, channels[shard].staging, self._encoder)
            for shard in range(self.num_shards)
        ]

    def _scatter(self, replies: list[Reply], pushed: bool = False) -> None:
        with self._shards.timeline.span("unpack"):
            for shard, reply in enumerate(replies):
                self.scatter_reply(shard, reply, pushed)

    def scatter_reply(
        self, shard: int, reply: Reply, pushed: bool, part: tuple[int, int] | None = None
    ) -> None:
        """Put the values of ``shard``'s reply (to a push when ``pushed``: in the values
        dtype asked for) into the model, once the reply is found to carry them so."""
        asked = self.values_dtype if pushed else None
        peer = self._shards.channels[shard].peer_name
        value_encoding.check_reply(reply.body, asked, peer)
        version = reply.body.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ProtocolError(
                f"{peer}'s values came with version {version!r}, not a whole number >= 0"
            )
        self._bound().scatter(shard, reply.buffers, part, asked)
        self._values_versions[shard] = version

    def trace(self, timeline: Timeline) -> None:
        """Record this client's exchanges (pack, the sends by op, wait, unpack) in ``timeline``."""
        self._shards.timeline = timeline

    def _progress(self, replies: list[Reply]) -> Progress:
        self._last_global_step = int(replies[0].body.get("global_step", 0))
        return Progress(
            global_step=self._last_global_step,
            stop=any(r.body.get("stop") is True for r in replies),
            made_step=replies[0].body.get("made_step", True) is True,
            dropped=any(r.body.get("dropped") is True for r in replies),
            checkpoint_requested=any(r.body.get("checkpoint") is True for r in replies),
        )
