"""``BucketedPush``: a step's gradients pushed bucket by bucket during the backward pass,
every bucket on its way as soon as it is complete, and (with prefetch) the step's replies
left to arrive during the next step. The settings and where they apply are
:mod:`tensorfleet.worker.push_overlap`'s; the buckets
:mod:`tensorfleet.worker.gradient_buckets`'; the ps side :mod:`tensorfleet.ps.partial_push`'s.

How a step goes. :meth:`StepOverlap.backward` arms a post-accumulate-grad hook on every
registered parameter for the session's own ``loss.backward()`` only (never for an
evaluation, nor for a backward the step closure runs itself, e.g. to accumulate gradients:
a gradient accumulated there and completed in the session's backward fires its hook then).
Each hook marks its parameter; a bucket whose parameters are all marked is queued for its
shard, and every hook sends a shard's queued buckets at once, as one request when they are
adjacent ranges: a shard may have several requests in flight (a channel keeps several, and
the shard applies and answers them in order), none waits for the reply to another, up to
:data:`MAX_IN_FLIGHT` (then the next bucket waits for the oldest reply, merged with the
adjacent ones queued meanwhile).
:meth:`exchange` then queues every bucket not sent yet (a shard with none sent during the
backward gets one whole push) and sends it; without prefetch it waits for every reply of
the step, with prefetch for every reply of the step before (still in flight when this step
began), so that the next forward pass uses values at most one step behind the worker's own
updates; and it puts every reply taken into the model. The last bucket to shard 0 carries
``count_step`` and the data position, and is sent by :meth:`exchange`, which knows them.

Why not one request in flight per shard (the rule before 2026-11-28): the next bucket then
waited a whole round trip for the reply to the one before, though the shard applies a
channel's requests in order anyway. On one H200 a 1 ps + 1 worker step of the example's CNN
spent 2.2 ms of its 8.3 ms in that wait (``--prefetch``, worker timeline, 2026-11-28); over a
1 Gbit/s link it held back the small last bucket for the 6.3 MB of ``fc1`` going up and
coming back (``benchmarks/overlap.py --rate 1gbit --workers 1``). Why the next step's
buckets do not wait for the step before either (a rule tried on the way): with prefetch the
whole of the next backward's gradients then queued behind the last replies and left as one
request after them, so their upload no longer overlapped the backward pass, and over that
link the MLP with prefetch ran at 1.12x the sequential step against 1.44x without prefetch.

Values. A reply's values go into the model only at a safe point: after the backward
(:meth:`exchange`), before the next forward (:meth:`StepOverlap.before_forward`, prefetch),
or when the exchange is settled (:meth:`settle`). Never during a backward pass: autograd's
saved tensors would see them. Replies taken in between (a prefetched reply taken during the
next backward) wait, in the order they arrived, and go in first at the next safe point, so
each variable ends with the newest value it was sent. None is dropped: with prefetch the
last requests of every step are the ones left in flight, and dropping a reply whenever it
came during the next backward would leave its variables stale for as long as that kept
happening (a cluster test under load caught it).

Failures. A push is never sent twice. When a request fails in a way the client recovers
from (:data:`~tensorfleet.worker.client.RECOVERABLE`: the ps restarted, fell silent, did not
answer in time), nothing more is sent for the step; at the next safe point the client
recovers and pulls, and the step is reported dropped (``recovered``). Buckets already
applied stay applied, as a push applied by one shard and not by another already could. A
refusal (a :class:`~tensorfleet.errors.RemoteError` the client does not recover from) is
raised at the next safe point.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorfleet.errors import ConnectionLost, TensorfleetError
from tensorfleet.wire.channel import Reply
from tensorfleet.wire.shared_memory import MAX_REQUEST_SEGMENTS
from tensorfleet.worker.client import RECOVERABLE, ParameterClient
from tensorfleet.worker.gradient_buckets import Bucket, BucketFill, BucketPlan
from tensorfleet.worker.progress import Progress
from tensorfleet.worker.push_overlap import Overlap
from tensorfleet.worker.sparse_gradient import densify_sparse_gradients

log = logging.getLogger("tensorfleet.worker")

#: Requests a worker keeps in flight to one shard; more buckets queue (and go as one request
#: with the adjacent ones queued beside them) until a reply frees a place. As many as a
#: same-host channel has request segments, so that on one host every payload in flight is in
#: shared memory (one more would go through ZeroMQ, a copy each way); it also bounds the
#: messages and the memory of a model cut into many buckets.
MAX_IN_FLIGHT = MAX_REQUEST_SEGMENTS
_NOTHING: AbstractContextManager[None] = nullcontext()


@dataclass
class _Flight:
    """A push awaiting its reply."""

    request_id: int
    bucket: Bucket
    whole: bool
    counting: bool
    sent_ns: int
    step: int
    """The :class:`BucketedPush`'s serial number of the step that sent it."""


@dataclass
class _Shard:
    """One shard's pushes in the current step."""

    queue: deque[Bucket] = field(default_factory=deque)
    queued: set[int] = field(default_factory=set)
    """Positions of the buckets queued or sent this step."""
    unsent: set[int] = field(default_factory=set)
    """Positions of the buckets not sent yet this step."""
    flights: deque[_Flight] = field(default_factory=deque)
    """Its requests awaiting their replies, oldest first (the order the shard answers)."""


class BucketedPush:
    """The overlapped pushes of one worker (see the module). ``hooks``: push buckets during
    the backward pass; ``prefetch``: leave each step's replies in flight."""

    def __init__(
        self,
        client: ParameterClient,
        named_params: Sequence[tuple[str, torch.Tensor]],
        overlap: Overlap,
        *,
        hooks: bool,
        prefetch: bool,
    ) -> None:
        self._client = client
        self._fused = client._bound()
        self._named_params = list(named_params)
        self._plan = BucketPlan(
            self._fused,
            [p for _, p in self._named_params],
            overlap.bucket_bytes if hooks else None,
        )
        self.prefetch = prefetch
        self._shards = [_Shard(unsent=set(range(len(b)))) for b in self._plan.shards]
        self._step_serial = 0
        """Counts the steps (:meth:`_next_step`), so that a request in flight tells which
        step sent it (what the exchange waits for with prefetch, :meth:`_owes`; whose memory
        a bucket must not be packed into, :meth:`_held`)."""
        self._fill: BucketFill | None = None
        self._replies: list[tuple[_Flight, Reply]] = []
        self._failure: BaseException | None = None
        self._unpack_now = False
        self._counted: Progress | None = None
        self._stop = False
        self._checkpoint_requested = False
        """A reply since the last progress asked for a checkpoint (a preempted shard)."""
        self._recovered = False
        self._session_step: int | None = None
        self._data: dict[str, Any] | None = None
        self._in_exchange = False
        self._mark_ns = 0
        self._handles: list[Any] = []
        if hooks:
            for index, (_, param) in enumerate(self._named_params):
                self._handles.append(
                    param.register_post_accumulate_grad_hook(self._hook_for(index))
                )

    @property
    def buckets(self) -> list[list[Bucket]]:
        """Each shard's buckets, in the order they fill."""
        return self._plan.shards

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._gradient_complete(index)

        return hook

    # -- the session's calls ----------------------------------------------------------------------

    def before_forward(self) -> None:
        """A safe point before the forward pass: take the replies that have arrived (their
        values go into the model) and recover from a failure seen since the last step."""
        self._unpack_now = True
        try:
            self._flush()
            for shard, state in enumerate(self._shards):
                while state.flights and self._ready(shard, state.flights[0]):
                    self._take(shard)
        finally:
            self._unpack_now = False
        if self._failure is not None:
            self._recover()

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Arm the hooks for the session's ``loss.backward()``."""
        if any(state.queued for state in self._shards):
            self._next_step()  # a step that never reached its exchange (it raised)
        self._fill = BucketFill(self._plan) if self._handles else None
        self._mark_ns = time.perf_counter_ns()
        try:
            yield
        finally:
            self._fill = None

    def exchange(self, step: int, data: dict[str, Any] | None) -> Progress:
        """Push what the backward pass did not, wait as the settings say, put the values that
        came back into the model; the step's progress (with prefetch: the newest known)."""
        self._session_step, self._data = step, data
        self._in_exchange = True
        try:
            for shard, state in enumerate(self._shards):
                if not state.queued:  # nothing during the backward: one whole push
                    self._enqueue(self._plan.whole[shard])
                else:
                    for bucket in self._plan.shards[shard]:
                        if bucket.position not in state.queued:
                            self._enqueue(bucket)
            while self._failure is None:
                self._pump()
                if self._failure is not None:
                    break
                # Without prefetch the step waits for its replies; with it, for those of the
                # step before (so the next forward is at most one step behind).
                waiting = [
                    shard
                    for shard, state in enumerate(self._shards)
                    if state.queue or self._owes(state)
                ]
                if not waiting:
                    break
                oldest = min(
                    (s for s in waiting if self._shards[s].flights),
                    key=lambda s: self._shards[s].flights[0].sent_ns,
                )
                with self._timeline().span("wait"):
                    self._take(oldest)
        finally:
            self._in_exchange = False
            self._data = None
        if self._failure is not None:
            dropped = self._recover()
            self._recovered = False  # said now, by this step's progress
            return dropped
        self._flush()
        self._next_step()
        counted, self._counted = self._counted, None
        recovered, self._recovered = self._recovered, False
        checkpoint, self._checkpoint_requested = self._checkpoint_requested, False
        if counted is None:  # prefetch: the count of this step is still in flight
            return Progress(
                self._client._last_global_step,
                self._stop,
                made_step=False,
                recovered=recovered,
                checkpoint_requested=checkpoint,
            )
        return Progress(
            counted.global_step,
            counted.stop or self._stop,
            counted.made_step,
            counted.dropped,
            recovered,
            checkpoint_requested=checkpoint,
        )

    def settle(self, discard: bool = False) -> None:
        """Wait for every request in flight and put its values into the model (``discard``:
        after a failure of the caller, just forget them); recover from a failure."""
        if discard:
            for state in self._shards:
                state.flights.clear()
            self._failure = None
            self._replies = []
            self._next_step()
            return
        self._unpack_now = True
        try:
            self._flush()
            for shard, state in enumerate(self._shards):
                while state.flights:
                    with self._timeline().span("wait"):
                        self._take(shard)
        finally:
            self._unpack_now = False
        self._counted = None  # the caller's own exchange (a pull, a save) says the progress now
        if self._failure is not None:
            self._recover()

    def close(self) -> None:
        """Remove the hooks from the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- internals -------------------------------------------------------------------------------

    def _timeline(self) -> Any:
        return self._client._shards.timeline

    def _gradient_complete(self, index: int) -> None:
        """A parameter's gradient is complete (its hook): queue and send what that allows."""
        if self._fill is None or self._failure is not None:
            return
        complete = self._fill.add(index)
        if complete:
            now = time.perf_counter_ns()
            for bucket in complete:
                self._timeline().add(
                    "bucket",
                    self._mark_ns,
                    now,
                    shard=bucket.shard,
                    bucket=bucket.position,
                    bytes=bucket.nbytes,
                )
                self._enqueue(bucket)
        self._pump()
        if complete:
            self._mark_ns = time.perf_counter_ns()

    def _enqueue(self, bucket: Bucket) -> None:
        state = self._shards[bucket.shard]
        state.queue.append(bucket)
        state.queued |= self._positions(bucket)

    def _positions(self, bucket: Bucket) -> set[int]:
        """The positions of the planned buckets that ``bucket`` (merged, or whole) covers."""
        return {
            b.position
            for b in self._plan.shards[bucket.shard]
            if bucket.start <= b.start and b.stop <= bucket.stop
        }

    @staticmethod
    def _adjacent(queue: deque[Bucket]) -> list[Bucket]:
        """The head of ``queue`` and every queued bucket that joins it into one range."""
        taken = [queue[0]]
        start, stop = queue[0].start, queue[0].stop
        grew = True
        while grew:
            grew = False
            for bucket in queue:
                if bucket not in taken and (bucket.stop == start or bucket.start == stop):
                    taken.append(bucket)
                    start, stop = min(start, bucket.start), max(stop, bucket.stop)
                    grew = True
        return taken

    @staticmethod
    def _merged(buckets: list[Bucket]) -> Bucket:
        if len(buckets) == 1:
            return buckets[0]
        return Bucket(
            buckets[0].shard,
            min(b.position for b in buckets),
            min(b.start for b in buckets),
            max(b.stop for b in buckets),
            sum(b.nbytes for b in buckets),
            frozenset().union(*(b.params for b in buckets)),
        )

    def _owes(self, state: _Shard) -> bool:
        """Whether the shard owes a reply the exchange waits for: any, without prefetch;
        with it, one to a request of the step before."""
        if not state.flights:
            return False
        return not self.prefetch or state.flights[0].step != self._step_serial

    def _pump(self) -> None:
        """Take the replies that have arrived (those that free a place for a queued bucket,
        or all of them when a timeline records when they arrive); send every shard its
        queued buckets, up to :data:`MAX_IN_FLIGHT` requests in flight."""
        looking = self._timeline().enabled
        for shard, state in enumerate(self._shards):
            if self._failure is not None:
                return
            while (
                state.flights
                and (looking or (state.queue and len(state.flights) >= MAX_IN_FLIGHT))
                and self._ready(shard, state.flights[0])
            ):
                self._take(shard)
            while state.queue and len(state.flights) < MAX_IN_FLIGHT and self._failure is None:
                taken = self._adjacent(state.queue)
                bucket = self._merged(taken)
                last = not state.unsent - self._positions(bucket)
                if last and shard == 0 and not self._in_exchange:
                    break  # shard 0's last request counts the step: the exchange sends it
                for item in taken:
                    state.queue.remove(item)
                self._send(shard, bucket)

    def _ready(self, shard: int, flight: _Flight) -> bool:
        channel = self._client._shards.channels[shard]
        if not channel.knows(flight.request_id):
            return True  # forgotten by a recovery meanwhile: _take reports it
        return self._client._shards.ready(shard, flight.request_id)

    def _send(self, shard: int, bucket: Bucket) -> None:
        state = self._shards[shard]
        state.unsent -= self._positions(bucket)
        last = not state.unsent
        whole = self._plan.is_whole(bucket)
        counting = last and shard == 0
        body: dict[str, Any] = {
            "task": self._client.task_name,
            "want_values": True,
            "count_step": counting,
            "step": self._session_step,
            **self._client.push_fields(),
            **self._client.based_on(shard),
        }
        if not whole:
            body.update(part=[bucket.start, bucket.stop], last=last)
        if counting and self._data is not None:
            body["data"] = self._data
        timeline = self._timeline()
        part = None if whole else bucket.part
        span = f"{bucket.start}-{bucket.stop}"
        densify_sparse_gradients([self._named_params[i] for i in sorted(bucket.params)])
        try:
            with timeline.span("pack", shard=shard, bucket=bucket.position, variables=span):
                buffers = self._pack(shard, part, self._held(shard, bucket))
            with timeline.span("push", shard=shard, bucket=bucket.position, variables=span):
                request_id = self._client._shards.send(
                    shard, "push", body, self._client.timeouts.step_s, buffers
                )
        except RECOVERABLE as exc:  # the send queue stayed full: the ps is unreachable
            self._failure = exc
            return
        state.flights.append(
            _Flight(request_id, bucket, whole, counting, time.perf_counter_ns(), self._step_serial)
        )

    def _held(self, shard: int, bucket: Bucket) -> bool:
        """Whether a request of an earlier step over some of ``bucket``'s variables is still
        in flight to ``shard``: its payload, when it went through ZeroMQ, may still be read
        from this worker's send buffers (ZeroMQ sends them without a copy, on its own
        thread), so this one must be packed elsewhere."""
        return any(
            flight.step != self._step_serial
            and flight.bucket.start < bucket.stop
            and bucket.start < flight.bucket.stop
            for flight in self._shards[shard].flights
        )

    @staticmethod
    def _fresh(sizes: list[int]) -> list[memoryview]:
        """Writable buffers of ``sizes`` bytes that nothing else references."""
        return [memoryview(torch.empty(size, dtype=torch.uint8).numpy()) for size in sizes]

    def _pack(self, shard: int, part: tuple[int, int] | None, held: bool) -> list[memoryview]:
        """The gradients of ``part`` of ``shard`` (all of them: None) for a push: straight
        into the request segment where the channel offers one (a segment is never offered
        while a request in flight holds it), else into the send buffers, or (``held``: a
        request still in flight may read those) into fresh memory; with a bf16 wire,
        encoded with the error feedback of their elements (``wire_dtype``)."""
        offered = self._client._shards.channels[shard].staging

        def staging(sizes: list[int]) -> list[memoryview] | None:
            targets = offered(sizes)
            return self._fresh(sizes) if targets is None and held else targets

        encoder = self._client._encoder
        if encoder is None:
            into = staging(self._fused.group_nbytes(shard, part))
            return self._fused.gather(shard, values=False, into=into, part=part)
        layout = self._fused.layouts[shard]
        slices = None if part is None else layout.part_slices(*part)
        scratch = self._fresh(self._fused.group_nbytes(shard, part)) if held else None
        gradients = self._fused.gather(shard, values=False, into=scratch, part=part)
        return encoder.encode(shard, layout.groups, gradients, staging, slices)

    def _take(self, shard: int) -> None:
        """The reply of ``shard``'s oldest request in flight (waiting for it if needed)."""
        flight = self._shards[shard].flights.popleft()
        try:
            if not self._client._shards.channels[shard].knows(flight.request_id):
                raise ConnectionLost(
                    f"{self._client.task_name}: the answer of ps:{shard} to a push was "
                    "forgotten by a recovery from another failure meanwhile"
                )
            reply = self._client._shards.wait(
                shard, flight.request_id, self._client.timeouts.step_s
            )
        except TensorfleetError as exc:  # recovered from, or (a refusal) raised, at a safe point
            self._failure = self._failure or exc
            return
        self._timeline().add(
            "in flight",
            flight.sent_ns,
            time.perf_counter_ns(),
            track=f"ps:{shard} pushes",
            bucket=flight.bucket.position,
            bytes=flight.bucket.nbytes,
            variables=f"{flight.bucket.start}-{flight.bucket.stop}",
        )
        self._stop = self._stop or reply.body.get("stop") is True
        self._checkpoint_requested |= reply.body.get("checkpoint") is True
        if shard == 0:  # the shard that owns the global step
            progress = self._client._progress([reply])
            if flight.counting:
                self._counted = progress
        self._replies.append((flight, reply))  # in arrival order: the newest value wins
        if self._unpack_now:
            self._flush()

    def _flush(self) -> None:
        """At a safe point: the values of every reply taken so far, oldest first."""
        replies, self._replies = self._replies, []
        self._unpack(replies)

    def _unpack(self, replies: list[tuple[_Flight, Reply]]) -> None:
        if not replies:
            return
        with self._timeline().span("unpack"):
            for flight, reply in replies:
                part = None if flight.whole else flight.bucket.part
                self._client.scatter_reply(flight.bucket.shard, reply, pushed=True, part=part)

    def _next_step(self) -> None:
        """Start a new step: the requests still in flight belong to the one before."""
        self._step_serial += 1
        for state, buckets in zip(self._shards, self._plan.shards, strict=True):
            state.queue.clear()
            state.queued.clear()
            state.unsent = set(range(len(buckets)))

    def _recover(self) -> Progress:
        """After a failure: forget what is in flight, recover, pull; a dropped step."""
        failure, self._failure = self._failure, None
        for state in self._shards:
            state.flights.clear()
        self._replies = []
        self._counted = None
        self._next_step()
        if not isinstance(failure, RECOVERABLE):
            assert failure is not None
            raise failure
        self._client.recover(failure)  # type: ignore[arg-type]
        pulled = self._client.pull()
        self._stop = self._stop or pulled.stop
        self._recovered = True
        return Progress(
            pulled.global_step,
            self._stop,
            made_step=False,
            dropped=True,
            recovered=True,
            checkpoint_requested=pulled.checkpoint_requested,
        )


class StepOverlap:
    """What the training session calls around a step (no-ops until the updater has a
    :class:`BucketedPush`, and for updaters without one: :data:`NO_STEP_OVERLAP`)."""

    def __init__(self, push: Callable[[], BucketedPush | None]) -> None:
        self._push = push

    def before_forward(self) -> None:
        """Before the step closure: a safe point to take values that have arrived."""
        push = self._push()
        if push is not None:
            push.before_forward()

    def backward(self) -> AbstractContextManager[None]:
        """Around the session's ``loss.backward()``: buckets go out as they complete (no
        push: a shared no-op context, nothing built per step)."""
        push = self._push()
        if push is None:
            return _NOTHING
        return push.backward()


#: The overlap of an updater that has none.
NO_STEP_OVERLAP = StepOverlap(lambda: None)


def step_overlap(updater: object, during_backward: bool) -> StepOverlap:
    """The :class:`StepOverlap` of ``updater`` (``during_backward``: buckets may go during
    the backward pass, nothing after it can change or veto the gradients), or
    :data:`NO_STEP_OVERLAP` for a mode without one."""
    factory = getattr(updater, "step_overlap", None)
    return factory(during_backward) if factory is not None else NO_STEP_OVERLAP
