"""Actor/learner: actors produce samples into a learner's bounded queue and follow its weights.

The learner runs a :class:`SampleQueueServer` (a thread serving the project's wire: every
message authenticated, tensors as raw buffers described by a msgpack header, never pickled)
and a :class:`~tensorfleet.patterns.broadcast.WeightPublisher`. An actor's
:class:`ActorClient` says hello (learning the sample spec and where the weights are
published), pushes batches stamped with the weight version that produced them, and pulls the
newest weights whenever it likes (e.g. every N samples).

* *Validation*: a batch must have exactly the spec's tensors, each with the spec's dtype and
  per-sample shape and the same number of rows; anything else is refused with an error naming
  the tensor, what was expected and what came (raised on the actor as
  :class:`SampleRejected`), and never reaches the queue.
* *Backpressure*: when the queue is full the push is held (not answered) until the learner
  takes a batch, up to the actor's deadline; the actor waits, then retries. A held push costs
  the learner nothing.
* *Staleness: max lag, dropped*. :meth:`SampleQueueServer.get` drops (and counts) batches
  produced by weights more than ``max_lag`` versions older than the learner's current one.
  Why a max lag and not V-trace: it is one rule with an invariant (every batch trained on is
  at most ``max_lag`` versions old), it works for any loss the learner uses, and with PPO's
  clipped importance ratio against the behaviour policy's log-probabilities (which actors
  send) a lag of one or two versions is already corrected; V-trace would tie the queue to one
  family of losses.
* *Failures*: the learner never waits on a particular actor (``get`` has a deadline and any
  actor's batch will do), so a dead or slow actor only lowers the sample rate; a restarted
  actor says hello again and is served like a new one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorfleet.errors import (
    ConfigError,
    DeadlineExceeded,
    RequestRefused,
    TensorfleetError,
)
from tensorfleet.patterns.broadcast import Snapshot, WeightSubscriber
from tensorfleet.patterns.serve_thread import ServeThread
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.service_socket import Request, ServiceSocket
from tensorfleet.wire.tensors import (
    DTYPES,
    as_buffer,
    dtype_name,
    from_buffer,
    parse_dtype,
    parse_shape,
)

#: How often the serving thread wakes to admit held pushes once the queue has room.
SERVE_TICK_S = 0.005
#: A held push is answered "full" this long before its deadline, so that the answer reaches
#: the actor before the actor stops waiting (its wait started before the learner's clock).
HELD_PUSH_MARGIN_S = 1.0
#: The most rows one batch may carry.
MAX_ROWS = 1 << 20


class SampleRejected(TensorfleetError, ValueError):
    """The learner refused a batch: wrong tensors, dtypes or shapes (the message says which)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a sample: its dtype and its shape without the leading batch dimension."""

    dtype: torch.dtype
    shape: tuple[int, ...] = ()


@dataclass
class SampleBatch:
    """A batch the learner got: its tensors ``[rows, *shape]``, the weight version that
    produced it, and the actor that sent it."""

    tensors: dict[str, torch.Tensor]
    version: int
    actor: str

    @property
    def rows(self) -> int:
        return next(iter(self.tensors.values())).shape[0]


def _spec_wire(spec: Mapping[str, TensorSpec]) -> dict[str, Any]:
    return {name: [dtype_name(s.dtype), list(s.shape)] for name, s in spec.items()}


def check_batch(
    spec: Mapping[str, TensorSpec], header: Mapping[str, Any], sizes: Sequence[int]
) -> int:
    """Check a batch's description against ``spec``; return its number of rows or raise
    :class:`SampleRejected` naming what does not fit."""
    names, dtypes, shapes = header.get("names"), header.get("dtypes"), header.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise SampleRejected("a batch needs names, dtypes and shapes (lists)")
    if not (len(names) == len(dtypes) == len(shapes) == len(sizes)):
        raise SampleRejected(
            f"{len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes, {len(sizes)} buffers"
        )
    if sorted(map(str, names)) != sorted(spec):
        raise SampleRejected(
            f"the batch holds tensors {sorted(map(str, names))}; the learner expects {sorted(spec)}"
        )
    rows = None
    for name, dt, shape in zip(names, dtypes, shapes, strict=True):
        expected = spec[name]
        if dt not in DTYPES or DTYPES[dt] != expected.dtype:
            raise SampleRejected(
                f"tensor {name!r} has dtype {dt}; the learner expects {dtype_name(expected.dtype)}"
            )
        try:
            shape = parse_shape(shape)
        except TensorfleetError as exc:
            raise SampleRejected(f"tensor {name!r}: {exc}") from None
        if len(shape) < 1 or tuple(shape[1:]) != expected.shape:
            raise SampleRejected(
                f"tensor {name!r} has shape {list(shape)}; the learner expects [rows, "
                f"{', '.join(map(str, expected.shape))}]".replace(", ]", "]")
            )
        if rows is None:
            rows = shape[0]
        elif shape[0] != rows:
            raise SampleRejected(f"tensor {name!r} has {shape[0]} rows, the others {rows}")
    if not rows or rows > MAX_ROWS:
        raise SampleRejected(f"a batch must hold 1..{MAX_ROWS} rows, got {rows}")
    return rows


class SampleQueueServer(ServeThread):
    """The learner's side: a bounded queue of validated batches, served at ``address``.

    ``weights_address`` is told to actors in the hello (where the learner's
    :class:`~tensorfleet.patterns.broadcast.WeightPublisher` serves)."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        spec: Mapping[str, TensorSpec],
        *,
        capacity: int = 4,
        weights_address: str | None = None,
        encrypt: bool = False,
    ) -> None:
        if capacity < 1:
            raise ConfigError(f"capacity must be >= 1, got {capacity}")
        self.address = address
        self.spec = dict(spec)
        self.capacity = capacity
        self._weights_address = weights_address
        self._queue: deque[SampleBatch] = deque()
        self._cond = threading.Condition()
        self.accepted = 0
        self.refused = 0
        self.dropped_stale = 0
        self.held_pushes = 0
        """Pushes that had to wait for room (backpressure)."""
        self.actors: set[str] = set()
        self.accepted_by: Counter[str] = Counter()
        """Batches accepted, by actor name."""
        self.rejected: dict[str, int] = {}
        self._held: deque[tuple[Request, SampleBatch]] = deque()
        """Pushes waiting for room, oldest first (of the serving thread only)."""
        self._start_serving(
            address,
            secret,
            encrypt=encrypt,
            name="sample-queue",
            what="the sample queue",
            tick_s=SERVE_TICK_S,
        )

    def __enter__(self) -> SampleQueueServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def get(self, timeout_s: float, min_version: int = 0) -> SampleBatch | None:
        """The oldest queued batch produced by weights of at least ``min_version`` (older
        ones are dropped and counted in :attr:`dropped_stale`); None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                while self._queue:
                    batch = self._queue.popleft()
                    self._cond.notify_all()
                    if batch.version >= min_version:
                        return batch
                    self.dropped_stale += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if self._failure is not None:
                    raise TensorfleetError(
                        f"the sample queue at {self.address} failed: {self._failure}"
                    )
                self._cond.wait(remaining)

    # --- the serving thread ----------------------------------------------------------------

    def _handle_request(self, service: ServiceSocket, request: Request) -> None:
        self._handle(service, request, self._held)

    def _after_tick(self, service: ServiceSocket) -> None:
        self._admit_held(service, self._held)
        self.rejected = dict(service.rejected)

    def _on_failure(self) -> None:
        with self._cond:  # get() reports it
            self._cond.notify_all()

    def _handle(
        self, service: ServiceSocket, request: Request, held: deque[tuple[Request, SampleBatch]]
    ) -> None:
        if request.op == "hello":
            actor = request.body.get("actor")
            if isinstance(actor, str):
                self.actors.add(actor[:100])
            service.reply(
                request, {"spec": _spec_wire(self.spec), "weights": self._weights_address}
            )
            return
        if request.op != "push":
            service.fail(
                request,
                "ProtocolError",
                f"unknown operation {request.op!r}; this is a sample queue",
            )
            return
        body = request.body
        version, actor = body.get("version"), body.get("actor")
        try:
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise SampleRejected(f"version must be an int >= 0, got {version!r}")
            if not isinstance(actor, str) or len(actor) > 100:
                raise SampleRejected(f"actor must be a short string, got {actor!r}")
            check_batch(self.spec, body, [memoryview(b).nbytes for b in request.buffers])
            tensors = {
                name: from_buffer(buf, parse_dtype(dt), parse_shape(shape)).clone()
                for name, dt, shape, buf in zip(
                    body["names"], body["dtypes"], body["shapes"], request.buffers, strict=True
                )
            }
        except TensorfleetError as exc:  # SampleRejected, and ProtocolError from the sizes
            self.refused += 1
            service.fail(request, RequestRefused.code, str(exc))
            return
        held.append((request, SampleBatch(tensors, version, actor)))
        if len(held) > 1 or not self._try_admit(service, request, held[-1][1]):
            self.held_pushes += 1
        else:
            held.pop()

    def _try_admit(self, service: ServiceSocket, request: Request, batch: SampleBatch) -> bool:
        with self._cond:
            if len(self._queue) >= self.capacity:
                return False
            self._queue.append(batch)
            self.accepted += 1
            self.accepted_by[batch.actor] += 1
            self._cond.notify_all()
        service.reply(request, {"accepted": True})
        return True

    def _admit_held(self, service: ServiceSocket, held: deque[tuple[Request, SampleBatch]]) -> None:
        while held:
            request, batch = held[0]
            if time.monotonic() >= request.deadline - HELD_PUSH_MARGIN_S:
                held.popleft()
                service.reply(request, {"accepted": False, "full": True})
                continue
            if not self._try_admit(service, request, batch):
                return
            held.popleft()


class ActorClient:
    """An actor's side: push version-stamped batches to the learner, follow its weights."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        name: str,
        *,
        encrypt: bool = False,
        timeout_s: float = 30.0,
    ) -> None:
        self.name = name
        self._channel = Channel(address, secret, "learner", encrypt=encrypt)
        try:
            hello = self._channel.call("hello", {"actor": name}, timeout_s=timeout_s)
            self.spec = {
                n: TensorSpec(parse_dtype(dt), parse_shape(shape))
                for n, (dt, shape) in hello.body["spec"].items()
            }
            weights = hello.body.get("weights")
            self._weights = (
                WeightSubscriber(weights, secret, encrypt=encrypt, timeout_s=timeout_s)
                if weights
                else None
            )
        except BaseException:
            self._channel.close()
            raise
        self.pushed = 0
        self.retries = 0

    @property
    def version(self) -> int:
        """The weight version this actor holds (0 before the first)."""
        return self._weights.version if self._weights else 0

    def newest_weights(self, wait_s: float = 0.0) -> Snapshot | None:
        """The learner's newest weights if newer than the ones held, else None."""
        if self._weights is None:
            raise TensorfleetError("this learner publishes no weights")
        return self._weights.newest(wait_s)

    def push(
        self, tensors: Mapping[str, torch.Tensor], version: int, timeout_s: float = 60.0
    ) -> None:
        """Send one batch produced with weights ``version``. Blocks while the learner's queue
        is full (backpressure), up to ``timeout_s``; :class:`SampleRejected` if it does not
        fit the spec."""
        contiguous = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
        names = list(contiguous)
        body = {
            "version": version,
            "actor": self.name,
            "names": names,
            "dtypes": [dtype_name(contiguous[n].dtype) for n in names],
            "shapes": [list(contiguous[n].shape) for n in names],
        }
        buffers = [as_buffer(contiguous[n]) for n in names]
        deadline = time.monotonic() + timeout_s
        while True:
            wait = min(10.0, deadline - time.monotonic())
            if wait <= 0:
                raise DeadlineExceeded(f"the learner's queue stayed full for {timeout_s:.0f} s")
            try:
                reply = self._channel.call("push", body, buffers, timeout_s=wait)
            except RequestRefused as exc:  # the learner's check (check_batch) refused it
                raise SampleRejected(str(exc)) from None
            if reply.body.get("accepted"):
                self.pushed += 1
                return
            self.retries += 1  # the queue was full for the whole wait: ask again

    def close(self) -> None:
        if self._weights is not None:
            self._weights.close()
        self._channel.close()
