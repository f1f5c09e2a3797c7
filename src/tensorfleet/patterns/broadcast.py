"""Model broadcast: a trainer publishes versioned weight snapshots; any number of subscribers
always get the newest one.

:class:`WeightPublisher` keeps the newest snapshot (a copy of the tensors, taken by
:meth:`~WeightPublisher.publish`, immutable afterwards) and serves it from a thread on the
project's wire (:class:`~tensorfleet.wire.service_socket.ServiceSocket`: every message
authenticated with the secret, msgpack header plus raw tensor buffers, never pickled, no
disk). :class:`WeightSubscriber` asks for "anything newer than version v"; the publisher
answers at once when it has something newer, else holds the request until it does (or until
the subscriber's wait ends): a long poll, so a new version reaches a waiting subscriber as
soon as it is published.

Why a long poll (pull) and not ZeroMQ PUB/SUB with a high-water mark of 1 or conflation:

* *newest, always*: a PUB socket drops a message for a subscriber whose pipe is full, so the
  last version can be the one dropped and the subscriber would hold an old one until the next
  publish; ``ZMQ_CONFLATE`` does not work with multipart messages (ours: envelope, header,
  one frame per tensor) and would force one copy of the whole model per message. Here the
  answer is built from the newest snapshot when the subscriber asks: versions it missed are
  skipped by construction, and the newest one is never lost.
* *a slow or dead subscriber never blocks the publisher*: ``publish()`` only swaps a
  reference (after copying the tensors once); the serving thread never waits on a peer
  (replies are sent non-blocking), holds at most one request per subscriber, and sends a
  subscriber a new snapshot only once its previous one has left (ZeroMQ's tracker), so a
  stalled subscriber pins at most one old snapshot in memory and costs nothing else.
* *authenticated*: a subscriber with the wrong secret gets the wire's "secret mismatch" error
  at its hello; the publisher drops its messages, counts them, and goes on.

The costs: one request per update per subscriber (a few hundred bytes), and one copy of the
tensors per publish (a snapshot must not change while it is being sent).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from tensorfleet.errors import ConfigError, DeadlineExceeded, ProtocolError, TensorfleetError
from tensorfleet.patterns.serve_thread import ServeThread
from tensorfleet.session.hooks import Hook, StepResult
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.message import Limits
from tensorfleet.wire.service_socket import Request, ServiceSocket
from tensorfleet.wire.tensors import as_buffer, dtype_name, from_buffer, parse_dtype, parse_shape

#: How often the serving thread wakes to answer held requests after a publish.
SERVE_TICK_S = 0.005
#: The longest a subscriber may ask the publisher to hold its request.
MAX_WAIT_S = 60.0


@dataclass(frozen=True)
class Snapshot:
    """One published version: its number, tensors by name, and small metadata."""

    version: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Held:
    request: Request
    after: int
    until: float
    """When to answer "unchanged" if nothing newer was published (the subscriber's wait)."""


def free_address(host: str = "127.0.0.1") -> str:
    """``host:port`` with a port that is free right now (for a publisher on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"


class WeightPublisher(ServeThread):
    """Serves the newest published snapshot at ``address`` (``host:port``) to subscribers
    holding ``secret``. Use as a context manager or call :meth:`close`."""

    def __init__(self, address: str, secret: bytes, *, encrypt: bool = False) -> None:
        self.address = address
        self._lock = threading.Lock()
        self._latest: tuple[Snapshot, dict[str, Any], list[memoryview]] | None = None
        self.published = 0
        self.replies_sent = 0
        self.replies_deferred = 0
        """Answers that waited because the subscriber had not taken its previous snapshot."""
        self.rejected: dict[str, int] = {}
        """Messages the wire dropped, by reason (``auth``: a peer without the secret)."""
        self.waiting = 0
        """Subscribers whose request is held until a newer version is published."""
        self._held: dict[bytes, _Held] = {}
        self._trackers: dict[bytes, zmq.MessageTracker] = {}
        """Both of the serving thread only."""
        self._start_serving(
            address,
            secret,
            encrypt=encrypt,
            name="weight-publisher",
            what="the weight publisher",
            tick_s=SERVE_TICK_S,
        )

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def version(self) -> int:
        """The newest published version (0 before the first publish)."""
        latest = self._latest
        return 0 if latest is None else latest[0].version

    def publish(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None = None
    ) -> int:
        """Publish a copy of ``tensors`` (e.g. ``model.state_dict()``) as the next version;
        return its number. Never waits on a subscriber. ``meta``: small msgpack-able data
        sent along (e.g. the global step)."""
        if self._failure is not None:
            raise TensorfleetError(
                f"the weight publisher at {self.address} failed: {self._failure}"
            )
        snapshot_tensors = {
            name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()
        }
        names = list(snapshot_tensors)
        header = {
            "names": names,
            "dtypes": [dtype_name(snapshot_tensors[n].dtype) for n in names],
            "shapes": [list(snapshot_tensors[n].shape) for n in names],
            "meta": dict(meta or {}),
        }
        buffers = [as_buffer(snapshot_tensors[n]) for n in names]
        with self._lock:
            version = self.version + 1
            header["version"] = version
            self._latest = (Snapshot(version, snapshot_tensors, dict(meta or {})), header, buffers)
            self.published += 1
        return version

    def publish_model(self, model: torch.nn.Module, meta: Mapping[str, Any] | None = None) -> int:
        """Publish ``model``'s parameters and buffers (its state_dict)."""
        return self.publish(model.state_dict(), meta)

    # --- the serving thread ----------------------------------------------------------------

    def _handle_request(self, service: ServiceSocket, request: Request) -> None:
        self._handle(service, request, self._held)

    def _after_tick(self, service: ServiceSocket) -> None:
        self._answer_held(service, self._held, self._trackers)
        self.rejected = dict(service.rejected)
        self.waiting = len(self._held)

    def _handle(self, service: ServiceSocket, request: Request, held: dict[bytes, _Held]) -> None:
        if request.op == "hello":
            service.reply(request, {"version": self.version})
            return
        if request.op != "weights":
            service.fail(
                request,
                "ProtocolError",
                f"unknown operation {request.op!r}; this is a weight publisher",
            )
            return
        after = request.body.get("after")
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            service.fail(
                request, "RequestRefused", f"'after' must be a version number >= 0, got {after!r}"
            )
            return
        wait_s = request.body.get("wait_s", 0.0)
        if (
            isinstance(wait_s, bool)
            or not isinstance(wait_s, (int, float))
            or not 0 <= wait_s <= MAX_WAIT_S
        ):
            service.fail(
                request, "RequestRefused", f"'wait_s' must be in 0..{MAX_WAIT_S:g}, got {wait_s!r}"
            )
            return
        until = min(request.deadline, time.monotonic() + wait_s)
        # One request per subscriber: a newer one replaces (and abandons) an older one.
        held[request.peer] = _Held(request, after, until)

    def _answer_held(
        self,
        service: ServiceSocket,
        held: dict[bytes, _Held],
        trackers: dict[bytes, zmq.MessageTracker],
    ) -> None:
        latest = self._latest
        now = time.monotonic()
        for peer, entry in list(held.items()):
            newer = latest is not None and latest[0].version > entry.after
            if newer:
                tracker = trackers.get(peer)
                if tracker is not None and not tracker.done:
                    self.replies_deferred += 1  # its previous snapshot has not left yet
                    if now >= entry.until:
                        del held[peer]  # it is not reading; it will ask again when it is
                    continue
                assert latest is not None
                _, header, buffers = latest
                sent = service.reply(entry.request, header, buffers)
                if sent is not None:
                    trackers[peer] = sent
                self.replies_sent += 1
                del held[peer]
            elif now >= entry.until:
                service.reply(entry.request, {"version": self.version, "unchanged": True})
                del held[peer]
        for peer in [p for p, t in trackers.items() if t.done]:
            del trackers[peer]


class WeightSubscriber:
    """Receives the newest snapshot from a :class:`WeightPublisher` at ``address``."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        *,
        encrypt: bool = False,
        timeout_s: float = 30.0,
        limits: Limits | None = None,
    ) -> None:
        self.address = address
        self.version = 0
        self._channel = Channel(address, secret, "weight publisher", limits=limits, encrypt=encrypt)
        try:
            self._channel.call("hello", {}, timeout_s=timeout_s)
        except BaseException:
            self._channel.close()
            raise

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def newest(self, wait_s: float = 0.0) -> Snapshot | None:
        """The newest snapshot if it is newer than the last one received (waiting up to
        ``wait_s`` for one to be published), else None."""
        wait_s = min(max(wait_s, 0.0), MAX_WAIT_S)
        reply = self._channel.call(
            "weights", {"after": self.version, "wait_s": wait_s}, timeout_s=wait_s + 10.0
        )
        if reply.body.get("unchanged"):
            return None
        snapshot = _decode_snapshot(reply.body, reply.buffers, self.version)
        self.version = snapshot.version
        return snapshot

    def wait_for(self, version: int, timeout_s: float) -> Snapshot:
        """Wait until a snapshot of at least ``version`` arrives; return the newest."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"no version >= {version} from the weight publisher at {self.address} within "
                    f"{timeout_s:.1f} s (newest received: {self.version})"
                )
            snapshot = self.newest(wait_s=min(remaining, 5.0))
            if snapshot is not None and snapshot.version >= version:
                return snapshot

    def load_into(self, model: torch.nn.Module, wait_s: float = 0.0) -> int:
        """Load the newest snapshot into ``model`` if there is a newer one; return the
        version the model now holds (unchanged when nothing newer came)."""
        snapshot = self.newest(wait_s)
        if snapshot is not None:
            model.load_state_dict(snapshot.tensors)
        return self.version

    def close(self) -> None:
        self._channel.close()


def _decode_snapshot(body: dict[str, Any], buffers: list[Any], previous: int) -> Snapshot:
    version, names = body.get("version"), body.get("names")
    dtypes, shapes, meta = body.get("dtypes"), body.get("shapes"), body.get("meta", {})
    if isinstance(version, bool) or not isinstance(version, int) or version <= previous:
        raise ProtocolError(f"snapshot version {version!r} is not above the one held ({previous})")
    if (
        not isinstance(names, list)
        or not all(isinstance(n, str) for n in names)
        or not isinstance(dtypes, list)
        or not isinstance(shapes, list)
        or not (len(names) == len(dtypes) == len(shapes) == len(buffers))
        or not isinstance(meta, dict)
    ):
        raise ProtocolError("malformed snapshot: names, dtypes, shapes and buffers do not match")
    tensors = {
        name: from_buffer(buf, parse_dtype(dt), parse_shape(shape)).clone()
        for name, dt, shape, buf in zip(names, dtypes, shapes, buffers, strict=True)
    }
    return Snapshot(version, tensors, meta)


class PublishWeights(Hook):
    """A session hook: the chief publishes the model every ``every_n_steps`` global steps
    (and at the end), so any training script becomes a publisher."""

    chief_only = True

    def __init__(self, publisher: WeightPublisher, every_n_steps: int = 100) -> None:
        if every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.publisher = publisher
        self.every_n_steps = every_n_steps
        self._last = -1

    def after_step(self, session: Any, result: StepResult) -> None:
        if result.global_step // self.every_n_steps != self._last // self.every_n_steps:
            self._last = result.global_step
            self.publisher.publish_model(_plain(session.model), {"global_step": result.global_step})

    def end(self, session: Any) -> None:
        self.publisher.publish_model(_plain(session.model), {"global_step": session.global_step})


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself, not its DistributedDataParallel wrapper (allreduce mode)."""
    return getattr(model, "module", model)
