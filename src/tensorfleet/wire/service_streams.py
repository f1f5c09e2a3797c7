"""A service's payload streams: which payloads take the stream, and the stream of each client.

A :class:`~tensorfleet.wire.service_socket.ServiceSocket` with streams on (the default;
``TENSORFLEET_PAYLOAD_STREAM=0`` turns them off: :func:`wanted`) listens on a second port
(:class:`~tensorfleet.wire.payload_stream.StreamListener`), names it in its answers to
``hello`` (``stream_port``), and keeps, per client session that opened a stream, a
:class:`~tensorfleet.wire.payload_stream.PayloadSender` (the replies' payloads) and a
:class:`~tensorfleet.wire.payload_collector.PayloadCollector` (the requests' payloads, which
the client sends there by the same rule of size, :data:`STREAM_MIN_BYTES`: see
:mod:`tensorfleet.wire.channel_stream`). Rule: a successful reply goes over its client's
stream when the client opened one (and it is alive), the reply is not sealed and not
written into the client's shared memory, and its payload has at least
:data:`STREAM_MIN_BYTES`; its header still goes over ZeroMQ, with ``stream`` in it, and the
payload's tracker (:class:`StreamTracker`) says when the payload left, as ZeroMQ's tracker
says for frames, so that the store's copy-on-write knows when its values may change again.
Everything else stays on ZeroMQ. Why this threshold: a payload below two chunks gains
nothing from overlapping its MACs with its transfer (one chunk is tagged before it leaves
either way) and a stream read costs a system call more than a ZeroMQ frame.

On by default (``TENSORFLEET_PAYLOAD_STREAM=0`` turns it off). The measured reason: between
hosts a pull of 8 MB is 1.6x faster on the stream, a push+pull 1.2x (docs/wire-performance.md,
"The push on the stream too"). What it needs: a second port open from the clients to the
service's host (a free one chosen at each start and named in the ``hello`` answer, or the one
``TENSORFLEET_PAYLOAD_STREAM_PORT`` sets: :func:`listen_port`; ``tensorfleet k8s render`` sets
it in every ps pod and declares it beside the task's port). Where a firewall or a Kubernetes
network policy that allows only the cluster spec's ports stops it, the client logs one line
and keeps its payloads on ZeroMQ, and a port that never answers is not tried again by that
connection (:mod:`tensorfleet.wire.channel_stream`). It ran off by default until it had
carried both directions through the cluster tests, the whole test suite with it on, and two
hosts (network namespaces: ``tests/multihost/test_payload_stream_hosts.py``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tensorfleet import environment
from tensorfleet.errors import ConfigError, ConnectionLost
from tensorfleet.wire.auth import (
    CHUNK_BYTES,
    REQUEST_ROLE,
    MessageSigner,
    MessageVerifier,
    derive_session_key,
)
from tensorfleet.wire.payload_collector import PayloadCollector, PendingPayload
from tensorfleet.wire.payload_stream import OPENED, READ_TIMEOUT_S, PayloadSender, StreamListener

log = logging.getLogger(__name__)

#: The smallest payload (bytes) a reply sends over its client's stream.
STREAM_MIN_BYTES = 2 * CHUNK_BYTES
#: Client streams a service holds at most; opening one more closes the least recent.
MAX_STREAMS = 1024


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the stream is on: unless ``TENSORFLEET_PAYLOAD_STREAM`` turns it off (``0``;
    unset, empty or ``1``: on). Any other value is a
    :class:`~tensorfleet.errors.ConfigError` naming it."""
    values = environment.environ() if environ is None else environ
    value = values.get(environment.PAYLOAD_STREAM_VAR, "")
    choice = value.strip().lower()
    if choice in ("0", "false", "no", "off"):
        return False
    if choice in ("", "1", "true", "yes", "on"):
        return True
    raise ConfigError(
        f"{environment.PAYLOAD_STREAM_VAR}={value!r} is neither on nor off: set it to 1 (large "
        "payloads over a TCP stream beside ZeroMQ, the default) or 0 (every payload on ZeroMQ)"
    )


def listen_port(environ: Mapping[str, str] | None = None) -> int:
    """The port a service's stream listens on: ``TENSORFLEET_PAYLOAD_STREAM_PORT`` (unset,
    empty or ``0``: 0, a free port chosen at each start). Anything but a port number is a
    :class:`~tensorfleet.errors.ConfigError` naming the value."""
    values = environment.environ() if environ is None else environ
    value = values.get(environment.PAYLOAD_STREAM_PORT_VAR, "")
    text = value.strip()
    if not text:
        return 0
    if text.isdigit() and 0 <= int(text) <= 65535:
        return int(text)
    raise ConfigError(
        f"{environment.PAYLOAD_STREAM_PORT_VAR}={value!r} is not a TCP port: set it to a port "
        "number in 1..65535 that the clients can reach (e.g. 2223), or unset it (or 0) for a "
        "free port chosen at each start"
    )


def listen_host(address: str) -> str:
    """The host a service's stream listens on: the host of its ZeroMQ address."""
    host = address.rpartition(":")[0].strip("[]")
    return "127.0.0.1" if host == "localhost" else host


class StreamTracker:
    """Whether a streamed payload has left (the ``done`` of ``zmq.MessageTracker``, which
    :mod:`tensorfleet.ps.copy_on_write` reads): set by the sender's thread, sent or not."""

    def __init__(self) -> None:
        self.done = False

    def finish(self, sent: bool) -> None:
        self.done = True


class PayloadPending(Exception):
    """An authentic request whose payload is still arriving on its client's stream: the
    service holds it until :attr:`payload` is done (:mod:`tensorfleet.wire.held_requests`)."""

    def __init__(self, payload: PendingPayload) -> None:
        super().__init__("payload pending")
        self.payload = payload


class PayloadFailed(Exception):
    """An authentic request whose payload did not arrive whole on its client's stream (the
    service refuses it with :class:`~tensorfleet.errors.PayloadStreamLost`)."""

    def __init__(self, error: Exception, header: dict[str, Any]) -> None:
        super().__init__(str(error))
        self.header = header


@dataclass
class ClientStream:
    """The two directions of one client's stream at the service."""

    sender: PayloadSender
    collector: PayloadCollector

    def close(self, linger_s: float = 0.0) -> None:
        """Close both directions, the replies' payloads queued so far given up to
        ``linger_s`` to leave."""
        self.sender.close(linger_s)
        self.collector.close()


class ServiceStreams:
    """The listener, and the stream of every client session that opened one. ``wake`` is
    called from a collector's thread when a request payload is done (the service's
    :meth:`~tensorfleet.wire.held_requests.HeldRequests.wake`)."""

    def __init__(
        self,
        address: str,
        secret: bytes,
        signer: MessageSigner,
        wake: Callable[[], None],
        service: str = "service",
    ) -> None:
        self._secret, self._signer, self._wake, self.service = secret, signer, wake, service
        self._streams: OrderedDict[bytes, ClientStream] = OrderedDict()
        self._lock = threading.Lock()
        self.listener = StreamListener(
            listen_host(address),
            MessageVerifier(secret, REQUEST_ROLE),
            signer.session_id,
            self._opened,
            port=listen_port(),
        )
        self.port = self.listener.port
        log.info(
            "%s: payload streams on %s:%d (a second port, which clients that share no memory with "
            "it connect to; TENSORFLEET_PAYLOAD_STREAM_PORT fixes it, TENSORFLEET_PAYLOAD_STREAM=0 "
            "turns them off)",
            service,
            listen_host(address),
            self.port,
        )
        self.sent = 0
        """Reply payloads handed to a stream."""
        self.received = 0
        """Request payloads read from a stream (counted by the service as it serves them)."""

    def _opened(self, session_id: bytes, conn: socket.socket) -> None:
        """A client opened its stream (the listener's thread): it replaces any earlier one of
        the same session; past :data:`MAX_STREAMS` the least recent is closed."""
        peer = f"the client of {self.service}"
        stream = ClientStream(
            PayloadSender(conn, self._signer, peer=peer, greeting=OPENED, start=False),
            PayloadCollector(
                conn.dup(),  # its own timeouts: see PayloadSender
                derive_session_key(self._secret, session_id, REQUEST_ROLE),
                self._wake,
                peer=peer,
            ),
        )
        with self._lock:
            retired = [self._streams.pop(session_id)] if session_id in self._streams else []
            self._streams[session_id] = stream
            while len(self._streams) > MAX_STREAMS:
                retired.append(self._streams.popitem(last=False)[1])
        stream.sender.start()  # registered before the client learns (OPENED) that it is open
        for old in retired:
            old.close()

    def sender_for(self, session_id: bytes, payload_bytes: int) -> PayloadSender | None:
        """The live stream a reply of ``payload_bytes`` to ``session_id`` takes, or None.
        Live means both directions: a collector that failed (an altered or cut payload)
        shut the connection down, which the sender learns only at its next write, so a reply
        sent there would be lost; it goes over ZeroMQ instead."""
        if payload_bytes < STREAM_MIN_BYTES:
            return None
        with self._lock:
            stream = self._streams.get(session_id)
        if stream is None or not (stream.sender.alive and stream.collector.alive):
            return None
        return stream.sender

    def collector_for(self, session_id: bytes) -> PayloadCollector | None:
        """The collector of the requests' payloads of ``session_id``'s stream, or None when
        that session has no stream here."""
        with self._lock:
            stream = self._streams.get(session_id)
        return stream.collector if stream is not None else None

    def request_payload(
        self,
        session_id: bytes,
        streamed: PendingPayload | None,
        header: dict[str, Any],
        counter: int,
        sizes: list[int],
    ) -> list[memoryview]:
        """The payload of the request message ``counter`` of ``session_id`` (its header
        verified, with ``stream``): its buffers when ``streamed``, the payload asked for
        before, is done and whole; :class:`PayloadFailed` when it failed or the session has
        no stream here; else asks the session's collector for it, to arrive within the
        request's deadline (at most :data:`~tensorfleet.wire.payload_stream.READ_TIMEOUT_S`),
        and raises :class:`PayloadPending` with it."""
        if streamed is not None:
            if streamed.error is not None:
                raise PayloadFailed(streamed.error, header)
            self.received += 1
            return streamed.buffers or []
        collector = self.collector_for(session_id)
        if collector is None:
            raise PayloadFailed(
                ConnectionLost("no payload stream of this client is open here"), header
            )
        timeout_ms = header.get("timeout_ms")
        seconds = timeout_ms / 1000 if type(timeout_ms) is int and timeout_ms >= 0 else 0.0
        deadline = time.monotonic() + min(seconds, READ_TIMEOUT_S)
        raise PayloadPending(collector.expect(counter, sizes, deadline))

    def stop_after_queued(self) -> None:
        """Every stream takes no more reply payloads and sends those queued (on their own
        threads, in parallel): the first half of a :meth:`close` that lingers."""
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.sender.stop_after_queued()

    def close(self, linger_s: float = 0.0) -> None:
        """Close the listener and every stream, giving the reply payloads queued so far up
        to ``linger_s`` in all to leave (the last reply of a ps that ends, a preempted
        one's answer to the chief's ``save``, must reach its client whole)."""
        self.listener.close()
        self.stop_after_queued()
        with self._lock:
            streams, self._streams = list(self._streams.values()), OrderedDict()
        deadline = time.monotonic() + linger_s
        for stream in streams:
            stream.close(max(0.0, deadline - time.monotonic()))
