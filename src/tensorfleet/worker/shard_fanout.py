"""``ShardFanout``: the one way the worker talks to its parameter servers, "send to every
shard, wait for all, give up early on a silent ps".

Every operation of :class:`~tensorfleet.worker.client.ParameterClient` (hello, create,
wait_ready, pull, push, save, restore, end, wait_done, done, stats) goes through
:meth:`ShardFanout.call`, which adds the model's namespace to every body, so all of them behave alike on failure: every shard is sent to
before any is waited on (the transfers overlap), each wait has a deadline a little longer
than the request's own (the ps gives up first and says why, so its explanation is what the
user sees), and a wait ends at once with :class:`~tensorfleet.errors.ConnectionLost` when
the heartbeat says the shard fell silent or restarted, instead of sitting out the deadline
(except for the requests that keep a shard too busy to answer heartbeats: creating or
restoring its variables, and the wait for that; their deadline decides). A wait that has
nothing to save behind it (``interruptible``: the hello) ends with
:class:`~tensorfleet.errors.Preempted` as soon as the task is preempted
(:mod:`tensorfleet.preemption_event`).

**A step's exchange after a preemption is bounded.** A preempted worker finishes the step
it is in, its push included, then leaves; a push (or a row lookup or row push,
:data:`STEP_EXCHANGE_OPS`) still unanswered :data:`EXCHANGE_GRACE_AFTER_PREEMPTION_S` after
the SIGTERM is given up with :class:`~tensorfleet.errors.ConnectionLost` naming why, and the
client's recovery then ends the task with status 143 (its hello is interruptible). The
measured reason: in a 10-minute fault storm a worker whose ps had been SIGSTOPped at the same
time waited 70 s for a push reply while the ps answered its heartbeats (so the silence rule
never fired), ignored the SIGTERM that came meanwhile for 40 s, and took the storm's worker
SIGTERM recovery p95 from about 1 s to 14 s (docs/reliability.md, seed 6). Nothing is lost
by giving the push up: the ps applies it or not, never twice, as for a worker killed in the
middle of a push. Other requests keep their deadlines: the chief's checkpoint after a
preemption (``save``) must have the time it needs.

A caller that keeps requests in flight to a shard while it does other work (the pushes of
gradient buckets during the backward pass, :mod:`tensorfleet.worker.bucketed_push`) uses the
single-shard :meth:`ShardFanout.send`, :meth:`~ShardFanout.ready` and
:meth:`~ShardFanout.wait`, which add the same namespace and wait the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensorfleet.errors import UsageError
from tensorfleet.preemption_event import raise_if_preempted, seconds_since_preempted
from tensorfleet.wire.channel import Channel, Reply
from tensorfleet.worker.heartbeat import Heartbeat
from tensorfleet.worker.timeline import NO_TIMELINE, Timeline

#: Extra seconds a client waits beyond a request's own deadline for the server's explanation.
ANSWER_MARGIN_S = 2.0
#: The requests of a training step whose wait a preemption bounds (module docstring).
STEP_EXCHANGE_OPS = frozenset({"push", "push_rows", "pull_rows"})
#: Seconds after its SIGTERM that a preempted worker still waits for a step's exchange: well
#: inside a launcher's (15 s) and Kubernetes' (30 s) grace periods, and many times the
#: seconds a healthy ps takes to answer a push of a big model.
EXCHANGE_GRACE_AFTER_PREEMPTION_S = 10.0


class ShardFanout:
    """One request per shard (all of them, or ``shards``), sent together, awaited together."""

    def __init__(
        self,
        channels: Sequence[Channel],
        heartbeat: Heartbeat,
        request_fields: dict[str, Any] | None = None,
    ) -> None:
        self.channels = list(channels)
        self._heartbeat = heartbeat
        self._draining: dict[int, object] = {}
        """Shard -> the server session whose replies asked for a checkpoint: preempted, that
        process ends once the chief has written one."""
        self.request_fields = dict(request_fields or {})
        """Added to every request's body: the model's namespace (``{"model": name}``), or
        nothing for the default model."""
        self.timeline: Timeline = NO_TIMELINE
        """Where the sends (named by their op) and the waits for the replies are recorded."""

    @property
    def num_shards(self) -> int:
        return len(self.channels)

    def call(
        self,
        op: str | Sequence[str],
        body: dict[str, Any] | Sequence[dict[str, Any]],
        timeout_s: float,
        buffers: Sequence[Sequence[Any] | None] | None = None,
        shards: Sequence[int] | None = None,
        abort_when_silent: bool = True,
        interruptible: bool = False,
    ) -> list[Reply]:
        """Send ``op`` with ``body`` (one for all, or one per shard in ``shards`` order, as
        are ``op`` and ``buffers`` when sequences) to each of ``shards`` (default: all), then
        wait for every reply. Returns the replies in ``shards`` order. Raises what the first
        failing wait raises (RemoteError and its typed subclasses, DeadlineExceeded,
        ConnectionLost).

        ``abort_when_silent`` False: wait out the deadline even while the shard answers no
        heartbeat. For the requests that keep a shard busy without a reply to anything else
        (creating or restoring its variables; the first creation also loads torch's
        optimizer code) and for the wait for them: a silence then means the shard is
        working for us, and the deadline, not the silence, must decide.

        ``interruptible``: a preemption of this task ends the wait with
        :class:`~tensorfleet.errors.Preempted` (checked every quarter second); for requests
        with nothing to save behind them (the hello), never for a push, which a preempted
        worker finishes."""
        targets = list(range(self.num_shards)) if shards is None else list(shards)
        ops = [op] * len(targets) if isinstance(op, str) else list(op)
        bodies = [body] * len(targets) if isinstance(body, dict) else list(body)
        if self.request_fields:
            bodies = [{**b, **self.request_fields} for b in bodies]
        sends = [None] * len(targets) if buffers is None else list(buffers)
        if not len(ops) == len(bodies) == len(sends) == len(targets):
            raise UsageError(  # the caller's sequences must align with the shards
                f"{len(targets)} shards, {len(ops)} ops, {len(bodies)} bodies, {len(sends)} buffers"
            )
        with self.timeline.span(ops[0] if ops else "send"):
            ids = [
                self.channels[shard].send(o, b, list(s) if s is not None else None, timeout_s)
                for shard, o, b, s in zip(targets, ops, bodies, sends, strict=True)
            ]
        with self.timeline.span("wait"):
            return self._wait_all(targets, ids, timeout_s, abort_when_silent, interruptible, op)

    def draining(self) -> set[int]:
        """The shards whose current process asked for a checkpoint (preempted: it ends once
        the chief has written one; a restarted process at the same place is not)."""
        return {
            shard
            for shard, session in self._draining.items()
            if session is not None and session == self.channels[shard].server_session
        }

    def send(
        self,
        shard: int,
        op: str,
        body: dict[str, Any],
        timeout_s: float,
        buffers: Sequence[Any] | None = None,
    ) -> int:
        """Send one request to ``shard`` (the namespace added); its id, for :meth:`wait`."""
        if self.request_fields:
            body = {**body, **self.request_fields}
        return self.channels[shard].send(
            op, body, list(buffers) if buffers is not None else None, timeout_s
        )

    def ready(self, shard: int, request_id: int) -> bool:
        """Whether :meth:`wait` for this request would return or raise at once (never
        blocks)."""
        return self.channels[shard].ready(request_id)

    def wait(self, shard: int, request_id: int, timeout_s: float) -> Reply:
        """The reply to a request :meth:`send` sent with ``timeout_s``, waiting as
        :meth:`call` does (ended early when the heartbeat says the shard fell silent)."""
        return self._wait_all([shard], [request_id], timeout_s, abort_when_silent=True)[0]

    def _wait_all(
        self,
        targets: list[int],
        ids: list[int],
        timeout_s: float,
        abort_when_silent: bool,
        interruptible: bool = False,
        op: object = None,
    ) -> list[Reply]:
        """The replies to ``ids`` (sent to ``targets``), in that order."""

        def abort(shard: int, name: str | None) -> str | None:
            if interruptible:
                raise_if_preempted(f"ps:{shard} to answer {op!r}")
            if name in STEP_EXCHANGE_OPS:
                since = seconds_since_preempted()
                if since is not None and since > EXCHANGE_GRACE_AFTER_PREEMPTION_S:
                    return (
                        f"this task was preempted (SIGTERM) {since:.0f} s ago and ps:{shard} "
                        f"has not answered its {name!r} in that time (it answers heartbeats): "
                        f"the exchange is given up after {EXCHANGE_GRACE_AFTER_PREEMPTION_S:g} "
                        "s (the ps applies it or not, never twice), and the task leaves"
                    )
            if not abort_when_silent:
                return None
            return self._heartbeat.trouble(shard, self.channels[shard].server_session)

        replies = []
        for shard, request_id in zip(targets, ids, strict=True):
            channel = self.channels[shard]
            name = channel.pending_op(request_id)
            checks = abort_when_silent or interruptible or name in STEP_EXCHANGE_OPS
            reply = channel.wait(
                request_id,
                timeout_s + ANSWER_MARGIN_S,
                abort=(lambda shard=shard, name=name: abort(shard, name)) if checks else None,
            )
            if reply.body.get("checkpoint") is True or reply.body.get("ending") is True:
                self._draining[shard] = channel.server_session  # ("ending": its save's answer)
            replies.append(reply)
        return replies
