"""The client end of request/reply over ZeroMQ: a :class:`Channel` from one client to one
service (a DEALER socket), with request ids, deadlines, verified :class:`Reply` s and typed
remote errors.

Several requests can be in flight on one channel; a reply is matched to its request by id,
and one that answers an abandoned request is dropped and counted. A request in flight when
its connection drops ends its wait at once (:class:`~tensorfleet.errors.ConnectionLost`): ZeroMQ
does not resend it. A refusal is raised as the :class:`~tensorfleet.errors.RemoteError`
subclass its code names. See :mod:`tensorfleet.wire.transport` for what both ends share and
:mod:`tensorfleet.wire.service_socket` for the server end.

With ``encrypt=True`` a channel exchanges keys with the service before its first request
and before every ``hello``, seals its requests and accepts only sealed replies, besides the
answer to its key exchange and a service's refusal of keys it no longer holds
(:mod:`tensorfleet.wire.encryption`, :mod:`tensorfleet.wire.channel_handshake`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from tensorfleet.errors import (
    AuthenticationError,
    ConfigError,
    ConnectionLost,
    DeadlineExceeded,
    ProtocolError,
    RemoteError,
    ServiceRestarted,
    remote_error_class,
)
from tensorfleet.wire import message as wire
from tensorfleet.wire import shared_memory as shm
from tensorfleet.wire import zmq_frames
from tensorfleet.wire.auth import (
    REPLY_ROLE,
    REQUEST_ROLE,
    Buffer,
    MessageSigner,
    MessageVerifier,
)
from tensorfleet.wire.channel_handshake import ChannelHandshake, DeferredRequest
from tensorfleet.wire.channel_stream import ChannelStream, StreamPayloadFailed
from tensorfleet.wire.encryption import KEY_EXCHANGE_OP
from tensorfleet.wire.transport import (
    check_resolvable,
    set_connection_heartbeats,
    shared_memory_wanted,
    tcp_endpoint,
)

log = logging.getLogger("tensorfleet.wire")

#: A client send that cannot be queued for this long fails (a send never blocks forever).
SEND_TIMEOUT_MS = 10_000
#: At most this many characters of a refusal's code are shown in the client's message.
MAX_CODE_CHARS = 64
#: How often a waiting client checks its abort condition (e.g. a ps silent for too long).
ABORT_CHECK_S = 0.25


@dataclass
class Reply:
    """A verified reply: its body and buffers."""

    body: dict[str, Any]
    buffers: list[Buffer] = field(default_factory=list)


class Channel:
    """The client end towards one service: requests with ids and deadlines, verified replies.

    Several requests may be in flight; :meth:`wait` returns the reply to one of them and
    keeps the others' replies for later. Not thread-safe (one ZeroMQ socket).
    """

    def __init__(
        self,
        address: str,
        secret: bytes,
        peer_name: str,
        limits: wire.Limits | None = None,
        context: zmq.Context | None = None,
        encrypt: bool = False,
        shared_memory: bool | None = None,
        payload_stream: bool | None = None,
    ) -> None:
        check_resolvable(address, peer_name)
        self._shared_memory_allowed = shared_memory_wanted(shared_memory)
        self._segments: shm.ClientSegments | None = None
        self._probe: shm.Segment | None = None
        """A tiny segment a ``hello`` names, for the service to tell whether it can reach
        this process's shared memory (``shm_refused`` in its answer when not)."""
        self.shared_memory_refused: str | None = None
        """Why a service on this host cannot use this process's shared memory, or None."""
        self.address = address
        self.peer_name = peer_name
        self.limits = limits or wire.Limits()
        self.encrypt = encrypt
        self._own_context = context is None
        self._context = context or zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        self._socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        set_connection_heartbeats(self._socket)
        # Connection events: a request in flight when its connection drops is lost (ZeroMQ
        # does not resend it, and its answer could not come back), so its wait ends at once.
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._disconnects = 0
        self._sent_at_disconnects: dict[int, int] = {}
        self._socket.connect(tcp_endpoint(address))
        #: Where the secret came from (``ClusterSecret.source``), for a peer's refusal.
        self._secret_source: str | None = getattr(secret, "source", None)
        self._signer = MessageSigner(secret, REQUEST_ROLE)
        self._verifier = MessageVerifier(secret, REPLY_ROLE, max_sessions=16)
        self.stream = ChannelStream(secret, address, peer_name, payload_stream)
        """Large payloads over a TCP stream beside this socket, when on
        (:mod:`tensorfleet.wire.channel_stream`; ``payload_stream`` None: as the environment
        says; False for a channel of small messages only, e.g. heartbeats, which then opens
        no stream and holds none of the service's threads)."""
        self._handshake = ChannelHandshake(secret, self._signer.session_id) if encrypt else None
        self._next_id = 0
        self._pending: dict[int, str] = {}
        self._arrived: dict[int, Reply | Exception] = {}
        self.server_session: bytes | None = None
        self.dropped: Counter[str] = Counter()
        """Replies dropped, by reason (late replies to abandoned requests, bad messages)."""
        self.bytes_sent = 0
        self.bytes_received = 0
        """Bytes of the requests sent and the valid replies received: each message's envelope,
        header and tags plus its payload, whether in frames or in shared memory."""

    def send(
        self,
        op: str,
        body: dict[str, Any],
        buffers: list[Buffer] | None = None,
        timeout_s: float = 60.0,
    ) -> int:
        """Send a request; return its id for :meth:`wait`. Buffers are not copied and must
        stay unchanged until the reply has arrived. Encrypted, a key exchange goes first
        when there are no keys yet or ``op`` is ``hello``, and the request leaves when the
        keys arrive (:mod:`tensorfleet.wire.channel_handshake`)."""
        handshake = self._handshake
        if handshake is not None and handshake.needs_exchange(op):
            self._next_id += 1
            exchange_id = self._next_id
            body_of_exchange = handshake.start(exchange_id)
            self._transmit(exchange_id, KEY_EXCHANGE_OP, body_of_exchange, None, timeout_s, False)
        self._next_id += 1
        request_id = self._next_id
        if handshake is not None and handshake.exchange_id is not None:
            handshake.deferred.append(DeferredRequest(request_id, op, body, buffers, timeout_s))
            self._pending[request_id] = op
            self._count_disconnects()
            self._sent_at_disconnects[request_id] = self._disconnects
            return request_id
        self._transmit(request_id, op, body, buffers, timeout_s)
        return request_id

    def _transmit(
        self,
        request_id: int,
        op: str,
        body: dict[str, Any],
        buffers: list[Buffer] | None,
        timeout_s: float,
        sealed: bool = True,
    ) -> None:
        header = {
            "op": op,
            "id": request_id,
            "srv": self.server_session,
            "timeout_ms": int(timeout_s * 1000),
            "body": body,
        }
        buffers, in_frames = list(buffers or []), True
        payload_bytes = sum(memoryview(b).nbytes for b in buffers)
        if self._segments is not None and self.server_session is not None:
            extra, placed = self._segments.headers(request_id, op, buffers, self._pending)
            header.update(extra)
            if placed is not None:
                buffers, in_frames = placed, False
        if op == "hello" and self._shared_memory_allowed:
            if self._probe is None:
                self._probe = shm.Segment(shm.ALIGN)
            header["shm_probe"] = self._probe.describe()
        handshake = self._handshake
        sealer = handshake.encryption.sealer if sealed and handshake is not None else None
        streamed = in_frames and sealer is None and self.stream.takes(payload_bytes)
        if streamed:  # the header says so; the payload follows on the stream, below
            header[wire.STREAM_KEY], in_frames = {}, False
        frames = wire.encode(
            wire.KIND_REQUEST, header, buffers, self._signer, in_frames, sealer=sealer
        )
        try:
            zmq_frames.send_frames(self._socket, frames)
        except zmq.Again:
            raise DeadlineExceeded(
                f"cannot queue '{op}' for {self.peer_name} at {self.address} within "
                f"{SEND_TIMEOUT_MS / 1000:.0f} s: its send queue is full (unreachable for long?)"
                + (
                    "; no connection to it ever completed: check that it is running at that "
                    "address and that every task agrees on encryption (TENSORFLEET_ENCRYPT / "
                    "--encrypt)"
                    if self.server_session is None
                    else ""
                )
            ) from None
        if streamed:
            self.stream.send(self._signer.counter, buffers)
        self.bytes_sent += payload_bytes + sum(memoryview(f).nbytes for f in frames[:3])
        self._pending[request_id] = op
        if handshake is not None:
            handshake.sent(request_id, self._signer.counter)
        self._count_disconnects()
        self._sent_at_disconnects[request_id] = self._disconnects

    def staging(self, sizes: list[int]) -> list[memoryview] | None:
        """Writable buffers of ``sizes`` bytes in this channel's request segment, for the
        caller to build the payload of its next :meth:`send` in place (then passed to it
        as its buffers: nothing is copied into shared memory). None when the next request
        will not go through shared memory (TCP peer, small payload, segment in use): build
        the payload elsewhere. The views are valid until the next ``send``."""
        if self._segments is None or self.server_session is None:
            return None
        return self._segments.staging(sizes, self._pending)

    def wait(
        self,
        request_id: int,
        timeout_s: float,
        abort: Callable[[], str | None] | None = None,
    ) -> Reply:
        """The reply to ``request_id``, or :class:`DeadlineExceeded` after ``timeout_s``.
        A refusal is raised as the :class:`RemoteError` subclass of its code
        (:func:`~tensorfleet.errors.remote_error_class`: e.g. :class:`ServiceRestarted` when
        the service restarted since the hello, :class:`IdentityInUse`,
        :class:`RequestRefused`). ``abort`` is asked every quarter second while waiting; a
        reason it returns ends the wait with :class:`ConnectionLost`."""
        self._require_known(request_id)
        if request_id not in self._arrived and self._lost_to_disconnect(request_id):
            # A disconnect counted since the send (by ready() or a later send): answers that
            # arrived before it come first.
            self._receive_queued(request_id)
            if request_id not in self._arrived:
                raise self._connection_lost(request_id)
        deadline = time.monotonic() + timeout_s
        while request_id not in self._arrived:
            if zmq_frames.readable(self._socket):  # a reply waits: no poll system call
                self._receive_one()
                continue
            remaining = deadline - time.monotonic()
            slice_s = remaining if abort is None else min(remaining, ABORT_CHECK_S)
            ready = dict(self._poller.poll(max(1, int(slice_s * 1000)))) if remaining > 0 else {}
            if self._socket in ready:
                self._receive_one()  # answers that arrived before a disconnect come first
                continue
            if self._monitor in ready:
                self._count_disconnects()
                if self._lost_to_disconnect(request_id):
                    raise self._connection_lost(request_id)
                continue
            if remaining > 0:
                reason = abort() if abort is not None else None
                if reason is None:
                    continue
                op = self._pending.pop(request_id, "?")
                self._forget_request(request_id)
                raise ConnectionLost(
                    f"gave up waiting for {self.peer_name} at {self.address} to answer '{op}': {reason}"
                )
            if remaining <= 0:
                op = self._pending.pop(request_id, "?")
                self._forget_request(request_id)
                raise DeadlineExceeded(
                    f"no answer from {self.peer_name} at {self.address} to '{op}' within {timeout_s:.1f} s: "
                    f"check that the {self.peer_name} task is running and reachable at that address"
                    + (
                        ", and that every task agrees on encryption (TENSORFLEET_ENCRYPT / --encrypt)"
                        if self.server_session is None
                        else ""
                    )
                )
        self._pending.pop(request_id, None)
        self._forget_request(request_id)
        outcome = self._arrived.pop(request_id)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def pending_op(self, request_id: int) -> str | None:
        """The op of a request sent and not yet waited for, or None."""
        return self._pending.get(request_id)

    def _forget_request(self, request_id: int) -> None:
        self._sent_at_disconnects.pop(request_id, None)
        if self._handshake is not None:
            abandoned = self._handshake.forget(request_id)
            if abandoned is not None:  # nobody waits for that key exchange any more
                self._pending.pop(abandoned, None)
                self._sent_at_disconnects.pop(abandoned, None)

    def ready(self, request_id: int) -> bool:
        """Whether :meth:`wait` for ``request_id`` would return or raise at once: its reply
        (or refusal) has arrived, or its connection dropped since it was sent. Never blocks:
        it takes what ZeroMQ has received so far (for a caller that has other work to do
        meanwhile, e.g. a backward pass)."""
        self._require_known(request_id)
        self._receive_queued(request_id)
        if request_id in self._arrived:
            return True
        self._count_disconnects()
        return self._lost_to_disconnect(request_id)

    def knows(self, request_id: int) -> bool:
        """Whether ``request_id`` is still awaited here (False once awaited, or forgotten by
        :meth:`forget_pending` after a failure)."""
        return request_id in self._pending or request_id in self._arrived

    def _require_known(self, request_id: int) -> None:
        if not self.knows(request_id):
            raise ConfigError(
                f"request {request_id} was not sent on this channel or was already awaited"
            )

    def _receive_queued(self, request_id: int) -> None:
        """Take the messages ZeroMQ holds already (without waiting), until ``request_id``'s."""
        while request_id not in self._arrived and zmq_frames.readable(self._socket):
            self._receive_one()

    def _lost_to_disconnect(self, request_id: int) -> bool:
        """Whether the connection dropped since ``request_id`` was sent (as counted so far)."""
        return self._sent_at_disconnects.get(request_id, self._disconnects) < self._disconnects

    def _connection_lost(self, request_id: int) -> ConnectionLost:
        """The error for a request lost with its connection (it is no longer awaited)."""
        op = self._pending.pop(request_id, "?")
        self._forget_request(request_id)
        return ConnectionLost(
            f"the connection to {self.peer_name} at {self.address} dropped while "
            f"'{op}' was in flight; the request or its answer is lost"
            + (
                ". It never answered: check that every task agrees on encryption "
                "(TENSORFLEET_ENCRYPT / --encrypt)"
                if self.server_session is None
                else ""
            )
        )

    def call(
        self,
        op: str,
        body: dict[str, Any],
        buffers: list[Buffer] | None = None,
        timeout_s: float = 60.0,
    ) -> Reply:
        """Send a request and wait for its reply."""
        return self.wait(self.send(op, body, buffers, timeout_s), timeout_s)

    def _receive_one(self) -> None:
        frames = [f.buffer for f in zmq_frames.receive_frames(self._socket)]
        notice = wire.decode_notice(frames)
        if notice is not None:
            if self.server_session is None:  # before the handshake, a notice explains a refusal
                raise wire.notice_error(
                    notice, f"{self.peer_name} at {self.address}", self._secret_source
                )
            self.dropped["notice"] += 1
            return
        handshake = self._handshake
        try:
            msg = wire.decode(
                frames,
                wire.KIND_REPLY,
                self._verifier,
                self.limits,
                resolve=self._segments.resolve if self._segments is not None else None,
                openers=handshake.encryption.opener if handshake is not None else None,
                read_stream=self.stream.read,
            )
        except (AuthenticationError, ProtocolError):
            self.dropped["invalid"] += 1
            return
        except StreamPayloadFailed as failed:  # the header was authentic: its request fails
            error, header = failed.args
            re = header.get("re")
            if header.get("to") == self._signer.session_id and re in self._pending:
                self._arrived[re] = error
            else:
                self.dropped["stream"] += 1
            return
        if (
            handshake is not None
            and not msg.sealed
            and not handshake.unsealed_reply_expected(msg, self._pending)
        ):
            self.dropped["unencrypted"] += 1
            return
        self.bytes_received += sum(memoryview(f).nbytes for f in frames[:3]) + sum(
            memoryview(b).nbytes for b in msg.buffers
        )
        header = msg.header
        self._note_reply_placement(header)
        re, to = header.get("re"), header.get("to")
        if handshake is not None and not msg.sealed and to == self._signer.session_id:
            if re is None:  # the service holds no keys for us: the refusal names a counter
                re = handshake.refused_request(header)
            elif re == handshake.exchange_id:
                self._pending.pop(re, None)
                self._forget_request(re)
                self._keys_answered(handshake, msg)
                return
        if to != self._signer.session_id or re not in self._pending:
            self.dropped["unexpected"] += 1
            return
        if header.get("ok") is True and isinstance(header.get("body"), dict):
            if self._pending[re] == "hello":
                self.server_session = msg.session_id
                if self._segments is None and self._handshake is None:  # TCP, not sealed
                    self.stream.after_hello(header, self._signer, msg.session_id)
            self._arrived[re] = Reply(body=header["body"], buffers=msg.buffers)
        else:
            self._arrived[re] = self._refusal(header, self._pending[re])

    def _keys_answered(self, handshake: ChannelHandshake, msg: wire.Message) -> None:
        """The service answered the key exchange: take its key and send the requests that
        waited for it, or give each of them the refusal (e.g. ``EncryptionMismatch``)."""
        header = msg.header
        failure: Exception | None = None
        if header.get("ok") is True and isinstance(header.get("body"), dict):
            try:
                handshake.encryption.finish(header["body"], msg.session_id)
            except ProtocolError as exc:
                failure = exc
        for request in handshake.take_deferred():
            if request.request_id not in self._pending:
                continue  # abandoned meanwhile
            if failure is not None:
                self._arrived[request.request_id] = ProtocolError(
                    f"key exchange with {self.peer_name} at {self.address} failed: {failure}"
                )
            elif header.get("ok") is not True:
                self._arrived[request.request_id] = self._refusal(header, request.op)
            else:
                try:
                    self._transmit(
                        request.request_id,
                        request.op,
                        request.body,
                        request.buffers,
                        request.timeout_s,
                    )
                except DeadlineExceeded as exc:
                    self._arrived[request.request_id] = exc

    def _refusal(self, header: dict[str, Any], op: str) -> RemoteError:
        """The typed exception for a refusal: the class registered for its code (plain
        :class:`RemoteError` for a code this version does not know), its message naming the
        peer, the operation, the code and the server's explanation."""
        code = header.get("error_type")
        cls = remote_error_class(code)
        if cls is ServiceRestarted:
            return ServiceRestarted(
                f"{self.peer_name} at {self.address} restarted since this task said hello "
                f"(its answer to '{op}')"
            )
        label = code[:MAX_CODE_CHARS] if isinstance(code, str) and code else "Error"
        return cls(
            f"{self.peer_name} at {self.address} refused '{op}': "
            f"{label}: {header.get('error', 'no explanation given')}"
        )

    def _note_reply_placement(self, header: dict[str, Any]) -> None:
        """Use shared memory with a service that said (in its hello) it is on this host."""
        if self._segments is not None:
            self._segments.arrived(header)
        if "host" in header and header.get("re") in self._pending:
            local = self._shared_memory_allowed and header["host"] == shm.host_identity()
            refused = header.get("shm_refused")
            if local and refused is not None:
                local = False
                if self.shared_memory_refused is None:
                    log.warning(
                        "%s at %s is on this host but cannot open this task's shared memory "
                        "(%.300s): payloads to it go over TCP. Set TENSORFLEET_SHARED_MEMORY=0 "
                        "to choose that without trying",
                        self.peer_name,
                        self.address,
                        refused,
                    )
                self.shared_memory_refused = str(refused)
            if self._probe is not None:
                self._probe.close()
                self._probe = None
            if local and self._segments is None:
                self._segments = shm.ClientSegments()
            elif not local and self._segments is not None:
                self._segments.close()
                self._segments = None

    @property
    def uses_shared_memory(self) -> bool:
        """Whether payloads to and from this service go through shared memory."""
        return self._segments is not None

    def forget_pending(self) -> None:
        """Drop every request still in flight (after a failure, before saying hello again):
        late answers to them are ignored."""
        self._pending.clear()
        self._arrived.clear()
        self._sent_at_disconnects.clear()
        if self._handshake is not None:
            self._handshake.clear()

    def _count_disconnects(self) -> None:
        """Take the connection events that arrived (without waiting)."""
        while zmq_frames.readable(self._monitor):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnects += 1

    def close(self) -> None:
        """Close the socket (and the context if this channel made it)."""
        self.stream.close()
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        if self._own_context:
            self._context.term()
        if self._segments is not None:
            self._segments.close()
            self._segments = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
