"""The worker's side of the parameter servers: one channel per shard, fused buffers, every
shard in parallel.

A training step is one round trip per shard: the gradients of that shard's variables go out
as one buffer per dtype and the new values come back in the reply (``push`` with
``want_values``), so a step costs one latency, not two. All shards are sent to before any is
waited on, so the transfers overlap.

Failures: a heartbeat thread (:mod:`tensorfleet.worker.heartbeat`) tells the shards this task
is alive and notices a shard that falls silent or restarts. A step whose exchange fails that
way is dropped (never applied twice) and the client recovers: it says hello again with
back-off until the shard answers (up to ``ClientTimeouts.recover_s``); a restarted shard that
lost its variables is restored by the chief (from the newest checkpoint, through the
``restore_shards`` callback the session installs), and the other workers wait for that.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from tensorfleet import environment
from tensorfleet.errors import DeadlineExceeded, IdentityInUse, RemoteError, ServiceRestarted
from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.version import __version__
from tensorfleet.wire.message import PROTOCOL_VERSION, Limits
from tensorfleet.wire.tensors import DTYPES, as_buffer, from_buffer
from tensorfleet.wire.transport import Channel, Reply
from tensorfleet.worker.heartbeat import Heartbeat

log = logging.getLogger("tensorfleet.worker")

#: Extra seconds a client waits beyond a request's own deadline for the server's explanation.
ANSWER_MARGIN_S = 2.0


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
        for name in (
            "connect_s",
            "initialize_s",
            "step_s",
            "recover_s",
            "heartbeat_s",
            "ps_silence_s",
            "finish_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"ClientTimeouts.{name} must be positive, got {getattr(self, name)}"
                )


@dataclass(frozen=True)
class Progress:
    """What the parameter servers said about training after a pull or push."""

    global_step: int
    stop: bool
    """The chief has declared training over."""
    made_step: bool = True
    """This worker's push completed the global step (exactly one worker per step)."""
    dropped: bool = False
    """sync: this worker's gradients came too late for their step and were dropped (or the
    step was lost to a ps failure and the client recovered)."""
    recovered: bool = False
    """The exchange failed (a ps died, restarted or was cut off) and the client recovered."""


@dataclass(frozen=True)
class _Member:
    """One model tensor (or a row range of it) inside one shard's fused buffer."""

    param: torch.Tensor
    row_start: int
    row_stop: int
    whole: bool
    offset: int
    numel: int


class ParameterClient:
    """Pulls variables from and pushes gradients to every ps shard.

    Lifecycle: :meth:`connect`, :meth:`register` (the chief creates, the others wait for
    that), then :meth:`pull` / :meth:`push_pull` each step, and :meth:`finish`.
    Not thread-safe: one training thread owns it (the heartbeat thread has its own sockets).

    ``restore_shards`` (set by the chief's session) is called with the indices of shards that
    came back without their variables; it must bring every shard to one checkpoint (see
    :meth:`restore`) and return True, or return False when there is no checkpoint (the
    client then re-creates those shards from the chief's current values).
    """

    def __init__(
        self,
        ps_addresses: Sequence[str],
        secret: bytes,
        task_name: str,
        timeouts: ClientTimeouts | None = None,
        limits: Limits | None = None,
        encrypt: bool = False,
    ) -> None:
        if not ps_addresses:
            raise ValueError("a ParameterClient needs at least one ps address")
        self.task_name = task_name
        self.timeouts = timeouts or ClientTimeouts()
        self.instance = secrets.token_hex(8)
        """This process's claim to the task identity (the ps refuses a second live one)."""
        self.takeover = environment.predecessor_dead()
        """Whether the hello asks the ps to hand this process the identity at once (the
        launcher says the previous process of this task is dead)."""
        self.is_chief = False
        self.restore_shards: Callable[[list[int]], bool] | None = None
        self.restored_data: dict[str, Any] | None = None
        """This worker's data position as the ps last recorded it (None: none recorded)."""
        self._context = zmq.Context(io_threads=1)
        self._channels = [
            Channel(
                address, secret, f"ps:{i}", limits=limits, context=self._context, encrypt=encrypt
            )
            for i, address in enumerate(ps_addresses)
        ]
        self._members: list[list[list[_Member]]] = []  # shard -> group -> members
        self._layouts: list[FusedLayout] = []
        self._send_buffers: list[list[torch.Tensor]] = []
        self._variable_names: dict[str, str] = {}
        self._create_bodies: list[dict[str, Any]] = []
        self._initialized: list[bool] = []
        self._wait_bodies: list[dict[str, Any]] = []
        self._heartbeat = Heartbeat(
            ps_addresses,
            secret,
            task_name,
            self.instance,
            self._context,
            interval_s=self.timeouts.heartbeat_s,
            silence_s=self.timeouts.ps_silence_s,
            encrypt=encrypt,
        )

    @property
    def num_shards(self) -> int:
        return len(self._channels)

    def connect(self) -> list[bool]:
        """Say hello to every shard (checks versions and the secret) and start the heartbeat.
        Returns which shards have their variables already. A shard that refuses because
        another live process holds this task's identity (:class:`IdentityInUse`) is asked
        again until ``connect_s`` has passed (the predecessor of a restarted task falls
        silent)."""
        deadline = time.monotonic() + self.timeouts.connect_s
        delay = 0.5
        while True:
            try:
                replies = self._hello(max(1.0, deadline - time.monotonic()))
                break
            except IdentityInUse as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("%s: %s; asking again in %.1f s", self.task_name, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        self._heartbeat.start()
        self._initialized = [r.body.get("initialized") is True for r in replies]
        return list(self._initialized)

    def _hello(self, timeout_s: float) -> list[Reply]:
        body = {
            "protocol": PROTOCOL_VERSION,
            "version": __version__,
            "task": self.task_name,
            "instance": self.instance,
            "takeover": self.takeover,
        }
        for channel in self._channels:
            channel.forget_pending()
            channel.server_session = None
        return self._all("hello", [body] * self.num_shards, None, timeout_s)

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
            raise ValueError(
                f"placement plan for {plan.num_shards} shards, but the cluster has {self.num_shards} ps tasks"
            )
        params = dict(named_params)
        self._layouts, self._members, self._send_buffers = [], [], []
        self._variable_names = {
            s.stored_name: s.variable.name for shard in plan.shards for s in shard
        }
        for shard in plan.shards:
            layout = FusedLayout.of(
                [StoredVariable(s.stored_name, s.shape, s.variable.dtype) for s in shard]
            )
            by_name = {s.stored_name: s for s in shard}
            groups = []
            for group in layout.groups:
                members = []
                for var, offset in group.members:
                    piece = by_name[var.name]
                    members.append(
                        _Member(
                            params[piece.variable.name],
                            piece.row_start,
                            piece.row_stop,
                            piece.is_whole,
                            offset,
                            var.numel,
                        )
                    )
                groups.append(members)
            self._layouts.append(layout)
            self._members.append(groups)
            self._send_buffers.append(
                [torch.empty(g.numel, dtype=DTYPES[g.dtype]) for g in layout.groups]
            )

        variables = [[v.to_wire() for v in layout.variables] for layout in self._layouts]
        self.is_chief = is_chief
        self._create_bodies = [
            {
                "variables": variables[i],
                "rule": rule.to_wire(),
                "owns_global_step": i == 0,
                "discipline": (discipline or UpdateDiscipline()).to_wire(),
                "task": self.task_name,
            }
            for i in range(self.num_shards)
        ]
        self._wait_bodies = [
            {"variables": variables[i], "task": self.task_name} for i in range(self.num_shards)
        ]
        if is_chief and resume is not None:
            fresh = [i for i, ready in enumerate(self._initialized) if not ready]
            self.restore(resume[1], resume[0], fresh)
            replies = self._wait_ready(range(self.num_shards), self.timeouts.connect_s)
        elif is_chief:
            buffers = [self._gather(i, values=True) for i in range(self.num_shards)]
            replies = self._all("create", self._create_bodies, buffers, self.timeouts.connect_s)
            if not replies[0].body.get("created"):
                log.info("%s: variables already exist on the ps; adopting them", self.task_name)
        else:
            replies = self._wait_ready(range(self.num_shards), self.timeouts.initialize_s)
        self.restored_data = replies[0].body.get("data")
        return int(replies[0].body.get("global_step", 0))

    def _wait_ready(self, shards: Sequence[int], timeout_s: float) -> list[Reply]:
        shards = list(shards)
        ids = [
            self._channels[i].send("wait_ready", self._wait_bodies[i], None, timeout_s)
            for i in shards
        ]
        try:
            return [
                self._channels[i].wait(request_id, timeout_s + ANSWER_MARGIN_S)
                for i, request_id in zip(shards, ids, strict=True)
            ]
        except DeadlineExceeded as exc:
            raise DeadlineExceeded(
                f"{self.task_name}: the chief has not initialized the variables within "
                f"{timeout_s:.0f} s ({exc}). Is the chief (worker 0) running? "
                "Its output says why it has not."
            ) from None

    # -- checkpoints ----------------------------------------------------------------------------

    def save(self) -> tuple[int, list[memoryview]]:
        """Every shard's state as a safetensors document, and the global step (shard 0's)."""
        replies = self._all(
            "save", [{"task": self.task_name}] * self.num_shards, None, self.timeouts.step_s
        )
        documents = []
        for shard, reply in enumerate(replies):
            if len(reply.buffers) != 1:
                raise RuntimeError(
                    f"ps:{shard} answered 'save' with {len(reply.buffers)} buffers, expected 1"
                )
            documents.append(memoryview(reply.buffers[0]))  # written as received: no copy
        return int(replies[0].body.get("global_step", 0)), documents

    def restore(
        self, documents: Sequence[bytes], global_step: int, fresh: Sequence[int] = ()
    ) -> None:
        """Bring every shard to one checkpoint: shards in ``fresh`` (restarted, no variables)
        are created from their document, the others take it over their current state; all
        of them take ``global_step``."""
        if len(documents) != self.num_shards:
            raise ValueError(f"{len(documents)} shard documents for {self.num_shards} ps tasks")
        ops, bodies = [], []
        for shard in range(self.num_shards):
            if shard in fresh:
                ops.append("create")
                bodies.append(
                    {**self._create_bodies[shard], "restore": True, "global_step": global_step}
                )
            else:
                ops.append("restore")
                bodies.append({"task": self.task_name, "global_step": global_step})
        ids = [
            channel.send(op, body, [documents[shard]], self.timeouts.step_s)
            for shard, (channel, op, body) in enumerate(
                zip(self._channels, ops, bodies, strict=True)
            )
        ]
        for channel, request_id in zip(self._channels, ids, strict=True):
            channel.wait(request_id, self.timeouts.step_s + ANSWER_MARGIN_S)

    # -- recovery -------------------------------------------------------------------------------

    def recover(self, failure: Exception) -> None:
        """After an exchange failed (a ps died, restarted, or was cut off): say hello again,
        with back-off, until every shard answers; have restarted shards restored (the chief)
        or wait until they are (the others). DeadlineExceeded after ``recover_s``."""
        log.warning("%s: %s; recovering", self.task_name, failure)
        deadline = time.monotonic() + self.timeouts.recover_s
        delay, last = 0.5, failure
        while time.monotonic() < deadline:
            try:
                replies = self._hello(min(10.0, max(1.0, deadline - time.monotonic())))
                fresh = [i for i, r in enumerate(replies) if r.body.get("initialized") is not True]
                if fresh:
                    self._reinitialize(fresh, deadline)
                log.warning(
                    "%s: recovered%s", self.task_name, f" (ps {fresh} restored)" if fresh else ""
                )
                return
            except (DeadlineExceeded, RemoteError) as exc:
                last = exc
                log.warning(
                    "%s: not recovered yet (%s); trying again in %.1f s", self.task_name, exc, delay
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 5.0)
        raise DeadlineExceeded(
            f"{self.task_name}: the parameter servers did not come back within "
            f"{self.timeouts.recover_s:.0f} s (last error: {last}). Restart the failed ps task "
            "(tensorfleet launch --max-restarts N restarts it in place)"
        )

    def _reinitialize(self, fresh: list[int], deadline: float) -> None:
        if self.is_chief:
            if self.restore_shards is not None and self.restore_shards(fresh):
                return
            log.warning(
                "%s: ps %s restarted without variables and there is no checkpoint to restore; "
                "re-creating them from the chief's current values (their optimizer state is lost)",
                self.task_name,
                fresh,
            )
            ids = [
                self._channels[i].send(
                    "create",
                    self._create_bodies[i],
                    self._gather(i, values=True),
                    self.timeouts.step_s,
                )
                for i in fresh
            ]
            for i, request_id in zip(fresh, ids, strict=True):
                self._channels[i].wait(request_id, self.timeouts.step_s + ANSWER_MARGIN_S)
        else:
            self._wait_ready(fresh, min(30.0, max(1.0, deadline - time.monotonic())))

    def pull(self) -> Progress:
        """Bring the current values of every variable into the model (recovering first if a
        ps fails on the way)."""
        try:
            replies = self._all(
                "pull", [{"task": self.task_name}] * self.num_shards, None, self.timeouts.step_s
            )
        except (ServiceRestarted, DeadlineExceeded) as exc:
            self.recover(exc)
            replies = self._all(
                "pull", [{"task": self.task_name}] * self.num_shards, None, self.timeouts.step_s
            )
        self._scatter_values(replies)
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
        checkpoints. When a ps fails during the exchange the step is dropped, the client
        recovers and pulls, and the progress says ``recovered``."""
        bodies = [
            {
                "count_step": count_step and i == 0,
                "want_values": True,
                "task": self.task_name,
                "step": step,
                **({"data": data} if data is not None and i == 0 else {}),
            }
            for i in range(self.num_shards)
        ]
        buffers = [self._gather(i, values=False) for i in range(self.num_shards)]
        try:
            replies = self._all("push", bodies, buffers, self.timeouts.step_s)
        except (ServiceRestarted, DeadlineExceeded) as exc:
            self.recover(exc)
            progress = self.pull()
            return Progress(
                progress.global_step, progress.stop, made_step=False, dropped=True, recovered=True
            )
        self._scatter_values(replies)
        return self._progress(replies)

    def moving_average(self) -> dict[str, torch.Tensor]:
        """The moving average the shards keep, as fresh tensors by parameter name."""
        bodies = [{"moving_average": True}] * self.num_shards
        replies = self._all("pull", bodies, None, self.timeouts.step_s)
        averages: dict[str, torch.Tensor] = {}
        for shard, reply in enumerate(replies):
            layout = self._layouts[shard]
            for group, members, buffer in zip(
                layout.groups, self._members[shard], reply.buffers, strict=True
            ):
                flat = from_buffer(buffer, DTYPES[group.dtype], (group.numel,))
                for m, (var, _) in zip(members, group.members, strict=True):
                    name = self._variable_names[var.name]
                    target = averages.setdefault(
                        name, torch.empty(m.param.shape, dtype=m.param.dtype)
                    )
                    piece = target if m.whole else target[m.row_start : m.row_stop]
                    piece.copy_(flat[m.offset : m.offset + m.numel].view(piece.shape))
        return averages

    def finish(self, declare_end: bool, before_done: Callable[[], None] | None = None) -> list[str]:
        """Tell every shard this worker is done. The chief first declares training over, waits
        (up to ``finish_s``, within the ps's grace period) until every other live worker is
        done, and runs ``before_done`` (the final checkpoint) while the shards still serve.
        Returns the workers still running when the chief stopped waiting."""
        running: list[str] = []
        if declare_end:
            replies = self._all(
                "end", [{"task": self.task_name}] * self.num_shards, None, self.timeouts.connect_s
            )
            grace = min(float(r.body.get("grace_s", 60.0)) for r in replies)
            wait_s = max(0.5, min(self.timeouts.finish_s, grace - 10.0))
            replies = self._all(
                "wait_done", [{"task": self.task_name}] * self.num_shards, None, wait_s
            )
            running = sorted({t for r in replies for t in r.body.get("running", [])})
            if running:
                log.warning(
                    "%s: %s still running %.0f s after the end of training; not waiting longer",
                    self.task_name,
                    ", ".join(running),
                    wait_s,
                )
            if before_done is not None:
                before_done()
        self._all(
            "done", [{"task": self.task_name}] * self.num_shards, None, self.timeouts.connect_s
        )
        return running

    def stats(self) -> list[dict]:
        """Each shard's counters (pushes, rejected messages, ...)."""
        return [
            r.body
            for r in self._all("stats", [{}] * self.num_shards, None, self.timeouts.connect_s)
        ]

    def close(self) -> None:
        self._heartbeat.stop()
        for channel in self._channels:
            channel.close()
        self._context.term()

    # -- internals ------------------------------------------------------------------------------

    def _all(
        self, op: str, bodies: list[dict], buffers: list[list] | None, timeout_s: float
    ) -> list[Reply]:
        ids = [
            ch.send(op, body, buffers[i] if buffers else None, timeout_s)
            for i, (ch, body) in enumerate(zip(self._channels, bodies, strict=True))
        ]
        # A ps gives up on a request it holds at timeout_s and says why; wait a little longer
        # than that, so that its explanation, not a bare timeout, is what the user sees.
        # Meanwhile the heartbeat may say the ps is gone or restarted: then stop waiting.
        return [
            ch.wait(
                request_id,
                timeout_s + ANSWER_MARGIN_S,
                abort=(
                    lambda shard=shard, ch=ch: self._heartbeat.trouble(shard, ch.server_session)
                ),
            )
            for shard, (ch, request_id) in enumerate(zip(self._channels, ids, strict=True))
        ]

    def _gather(self, shard: int, values: bool) -> list[memoryview]:
        """Pack the shard's values or gradients into its send buffers (one copy per tensor)."""
        out = []
        for members, flat in zip(self._members[shard], self._send_buffers[shard], strict=True):
            pieces = []
            for m in members:
                source = m.param.detach() if values else m.param.grad
                if source is None:
                    source = torch.zeros_like(m.param)
                if not m.whole:
                    source = source[m.row_start : m.row_stop]
                pieces.append(source.reshape(-1).cpu())  # a copy only for GPU tensors
            torch.cat(pieces, out=flat)
            out.append(as_buffer(flat))
        return out

    def _scatter_values(self, replies: list[Reply]) -> None:
        with torch.no_grad():
            for shard, reply in enumerate(replies):
                layout = self._layouts[shard]
                if len(reply.buffers) != len(layout.groups):
                    raise RuntimeError(
                        f"ps:{shard} sent {len(reply.buffers)} value buffers, expected {len(layout.groups)}"
                    )
                for group, members, buffer in zip(
                    layout.groups, self._members[shard], reply.buffers, strict=True
                ):
                    flat = from_buffer(buffer, DTYPES[group.dtype], (group.numel,))
                    for m in members:
                        values = flat[m.offset : m.offset + m.numel]
                        if m.whole and m.param.device.type == "cpu":
                            # Adopt the received memory as the parameter's storage: no copy.
                            # The tensor keeps the received frame alive; nothing else uses it.
                            m.param.data = values.view(m.param.shape)
                        else:
                            target = m.param if m.whole else m.param[m.row_start : m.row_stop]
                            target.copy_(values.view(target.shape))  # to the GPU, or into a slice

    @staticmethod
    def _progress(replies: list[Reply]) -> Progress:
        return Progress(
            global_step=int(replies[0].body.get("global_step", 0)),
            stop=any(r.body.get("stop") is True for r in replies),
            made_step=replies[0].body.get("made_step", True) is True,
            dropped=any(r.body.get("dropped") is True for r in replies),
        )
