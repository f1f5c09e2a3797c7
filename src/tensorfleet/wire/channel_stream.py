"""A channel's payload stream: opened after each ``hello`` whose answer names a stream port,
read when a reply's header says its payload follows on it, written with the payload of every
large request (:mod:`tensorfleet.wire.payload_stream`).

Rule. A channel with streams on (the default; ``TENSORFLEET_PAYLOAD_STREAM=0`` or
``Channel(payload_stream=False)`` turns them off) that is not using shared memory with its
service opens a stream when the service's answer to ``hello`` names its port (``stream_port``), after closing any stream it had (the service may have restarted:
a new process, a new stream). Where the stream cannot be opened (a firewall, a network
policy, a service that refuses it), the channel logs one line and goes on without (and,
when nothing answered within :data:`OPEN_TIMEOUT_S`, as behind a firewall that drops the
port, it does not try again: each try would hold a ``hello``, a recovery's first step, that
long): the service sends payloads over ZeroMQ to a client that opened no stream, so nothing
waits for a stream that does not exist. A reply whose header says ``stream`` has its payload read
from the stream before anything else is received, within :data:`STREAM_READ_TIMEOUT_S`;
a payload that fails (cut short, late, altered) ends that request with the error, and the
stream is closed until the next ``hello``. A request whose payload has at least
:data:`~tensorfleet.wire.service_streams.STREAM_MIN_BYTES` (the replies' rule) and is not
sealed sends its header over ZeroMQ with ``stream`` in it, then its payload on the stream,
tagged chunk by chunk on the stream's sender thread (:class:`PayloadSender`: the caller goes
on, as after a ZeroMQ send); the service reads it on a thread of its own
(:mod:`tensorfleet.wire.payload_collector`). A payload that does not reach the service whole
is refused there with :class:`~tensorfleet.errors.PayloadStreamLost`, which the client's
recovery treats as a restart: hello again (a new stream), then the request again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tensorfleet.errors import ConnectionLost, DeadlineExceeded, ProtocolError
from tensorfleet.wire.auth import REPLY_ROLE, Buffer, MessageSigner, derive_session_key
from tensorfleet.wire.payload_stream import (
    READ_TIMEOUT_S,
    PayloadReceiver,
    PayloadSender,
    open_stream,
)
from tensorfleet.wire.service_streams import STREAM_MIN_BYTES, wanted

log = logging.getLogger(__name__)

#: Seconds a streamed reply's payload may take to arrive once its header is in.
STREAM_READ_TIMEOUT_S = READ_TIMEOUT_S
#: Seconds the opening of a stream may take (a connect and one round trip).
OPEN_TIMEOUT_S = 10.0


class StreamPayloadFailed(Exception):
    """Reading a streamed payload failed: ``args[0]`` is the error for the request whose
    reply it was (``args[1]``, its header)."""


class ChannelStream:
    """The payload stream of one channel, if it has one."""

    def __init__(
        self, secret: bytes, address: str, peer_name: str, enabled: bool | None = None
    ) -> None:
        self._secret, self.address, self.peer_name = secret, address, peer_name
        self.enabled = wanted() if enabled is None else enabled
        """Whether this channel opens a stream (``enabled``; None: as the environment says)."""
        self._receiver: PayloadReceiver | None = None
        self._sender: PayloadSender | None = None
        self.refused: str | None = None
        """Why the last opening failed, or None."""
        self.payloads = 0
        """Reply payloads read from the stream."""
        self.sent = 0
        """Request payloads handed to the stream."""

    @property
    def open(self) -> bool:
        return (
            self._receiver is not None
            and self._receiver.failure is None
            and self._sender is not None
            and self._sender.alive
        )

    def takes(self, payload_bytes: int) -> bool:
        """Whether a request payload of ``payload_bytes`` (not sealed) goes on the stream."""
        return payload_bytes >= STREAM_MIN_BYTES and self.open

    def send(self, counter: int, buffers: list[Buffer]) -> None:
        """Send the payload of the request message ``counter`` (its header just went over
        ZeroMQ) on the stream's thread; the buffers must stay unchanged until the reply
        (the rule of :meth:`Channel.send`)."""
        assert self._sender is not None, "takes() said the stream is open"
        self._sender.send(counter, buffers, _ignore)
        self.sent += 1

    def after_hello(
        self, header: dict[str, Any], signer: MessageSigner, service_session: bytes
    ) -> None:
        """Open a stream to the service whose answer to hello ``header`` names a port (see the
        module); close the one there was."""
        self.close()
        port = header.get("stream_port")
        if not self.enabled or port is None:
            return
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ProtocolError(
                f"the hello answer's stream_port must be a port number, got {port!r}"
            )
        host = self.address.rpartition(":")[0].strip("[]")
        try:
            conn = open_stream(host, port, signer, service_session, OPEN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the payloads on ZeroMQ
            unanswered = isinstance(exc, DeadlineExceeded) and not isinstance(exc, ConnectionLost)
            if self.refused is None or unanswered:
                log.warning(
                    "cannot open the payload stream to %s at %s:%d (%s): its payloads stay on "
                    "ZeroMQ%s. Set TENSORFLEET_PAYLOAD_STREAM=0 to choose that without trying",
                    self.peer_name,
                    host,
                    port,
                    exc,
                    " and this connection does not try again (nothing answered: a firewall "
                    "dropping the port?)"
                    if unanswered
                    else "",
                )
            self.refused = str(exc)
            if unanswered:  # each try would hold the hello for up to OPEN_TIMEOUT_S
                self.enabled = False
            return
        key = derive_session_key(self._secret, service_session, REPLY_ROLE)
        where = f"{self.peer_name} at {host}:{port}"
        self._receiver = PayloadReceiver(conn, key, peer=where)
        # Its own socket object (a socket's timeout is per object) and the request key.
        self._sender = PayloadSender(conn.dup(), signer, peer=where)
        self.refused = None

    def read(self, header: dict[str, Any], counter: int, sizes: list[int]) -> list[memoryview]:
        """The payload of the reply ``counter`` (``wire.decode``'s ``read_stream``); a failure
        is raised as :class:`StreamPayloadFailed` carrying the error for that request."""
        if self._receiver is None:  # closed after a failure: the request fails at once
            raise StreamPayloadFailed(
                ConnectionLost(
                    f"the payload of a reply from {self.peer_name} at {self.address} is on a "
                    "payload stream this channel no longer has (closed after an error); it "
                    "reopens at the next hello"
                ),
                header,
            )
        try:
            buffers = self._receiver.receive(
                counter, sizes, time.monotonic() + STREAM_READ_TIMEOUT_S
            )
        except Exception as exc:  # noqa: BLE001 - the request's error: see StreamPayloadFailed
            raise StreamPayloadFailed(exc, header) from None
        self.payloads += 1
        return buffers

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close(linger_s=0)
            self._sender = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


def _ignore(sent: bool) -> None:
    """A request payload's ``on_done``: one that did not leave is refused by the service
    (:class:`~tensorfleet.errors.PayloadStreamLost`), so its request ends there."""
