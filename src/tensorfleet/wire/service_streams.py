"""A service's payload streams: which replies take the stream, and the stream of each client.

A :class:`~tensorfleet.wire.service_socket.ServiceSocket` with streams on
(``TENSORFLEET_PAYLOAD_STREAM=1``, :func:`wanted`) listens on a second port
(:class:`~tensorfleet.wire.payload_stream.StreamListener`), names it in its answers to
``hello`` (``stream_port``), and keeps one :class:`~tensorfleet.wire.payload_stream.PayloadSender`
per client session that opened a stream. Rule: a successful reply goes over its client's
stream when the client opened one (and it is alive), the reply is not sealed and not
written into the client's shared memory, and its payload has at least
:data:`STREAM_MIN_BYTES`; its header still goes over ZeroMQ, with ``stream`` in it, and the
payload's tracker (:class:`StreamTracker`) says when the payload left, as ZeroMQ's tracker
says for frames, so that the store's copy-on-write knows when its values may change again.
Everything else stays on ZeroMQ. Why this threshold: a payload below two chunks gains
nothing from overlapping its MACs with its transfer (one chunk is tagged before it leaves
either way) and a stream read costs a system call more than a ZeroMQ frame.

Why off by default: the stream is new, and it needs a second port open between the hosts
(a firewall or a Kubernetes network policy that allows only the cluster spec's ports would
stop it; the client then logs one line and keeps its payloads on ZeroMQ). The measured
reason to have it: docs/wire-performance.md, "The stream, built".
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Mapping

from tensorfleet import environment
from tensorfleet.errors import ConfigError
from tensorfleet.wire.auth import CHUNK_BYTES, REQUEST_ROLE, MessageSigner, MessageVerifier
from tensorfleet.wire.payload_stream import OPENED, PayloadSender, StreamListener

log = logging.getLogger(__name__)

#: The smallest payload (bytes) a reply sends over its client's stream.
STREAM_MIN_BYTES = 2 * CHUNK_BYTES
#: Client streams a service holds at most; opening one more closes the least recent.
MAX_STREAMS = 1024


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``TENSORFLEET_PAYLOAD_STREAM`` turns the stream on (``1``; unset or ``0``:
    off). Any other value is a :class:`~tensorfleet.errors.ConfigError` naming it."""
    values = environment.environ() if environ is None else environ
    value = values.get(environment.PAYLOAD_STREAM_VAR, "0")
    choice = value.strip().lower()
    if choice in ("", "0", "false", "no", "off"):
        return False
    if choice in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(
        f"{environment.PAYLOAD_STREAM_VAR}={value!r} is neither on nor off: set it to 1 (large "
        "reply payloads over a TCP stream beside ZeroMQ) or 0 (every payload on ZeroMQ, the "
        "default)"
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


class ServiceStreams:
    """The listener and the sender of every client session that opened a stream."""

    def __init__(
        self, address: str, secret: bytes, signer: MessageSigner, service: str = "service"
    ) -> None:
        self._signer, self.service = signer, service
        self._senders: OrderedDict[bytes, PayloadSender] = OrderedDict()
        self._lock = threading.Lock()
        self.listener = StreamListener(
            listen_host(address),
            MessageVerifier(secret, REQUEST_ROLE),
            signer.session_id,
            self._opened,
        )
        self.port = self.listener.port
        self.sent = 0
        """Reply payloads handed to a stream."""

    def _opened(self, session_id: bytes, conn: socket.socket) -> None:
        """A client opened its stream (the listener's thread): it replaces any earlier one of
        the same session; past :data:`MAX_STREAMS` the least recent is closed."""
        sender = PayloadSender(
            conn, self._signer, peer=f"the client of {self.service}", greeting=OPENED, start=False
        )
        with self._lock:
            retired = [self._senders.pop(session_id)] if session_id in self._senders else []
            self._senders[session_id] = sender
            while len(self._senders) > MAX_STREAMS:
                retired.append(self._senders.popitem(last=False)[1])
        sender.start()  # registered before the client learns (OPENED) that its stream is open
        for old in retired:
            old.close(wait=False)

    def sender_for(self, session_id: bytes, payload_bytes: int) -> PayloadSender | None:
        """The live stream a reply of ``payload_bytes`` to ``session_id`` takes, or None."""
        if payload_bytes < STREAM_MIN_BYTES:
            return None
        with self._lock:
            sender = self._senders.get(session_id)
        return sender if sender is not None and sender.alive else None

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            senders, self._senders = list(self._senders.values()), OrderedDict()
        for sender in senders:
            sender.close(wait=False)
