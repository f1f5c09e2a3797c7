"""Request/reply over ZeroMQ: a :class:`ServiceSocket` that serves many peers, and a
:class:`Channel` from one client to one service.

Every request has an id and a deadline, every reply names the request it answers, and
every message is authenticated (see :mod:`tensorfleet.wire.message`). A service never
crashes on bad input: it drops and counts what it cannot accept, and tells a peer that
cannot authenticate (once) so that the peer fails with a clear error instead of a timeout.

Between tasks on one host, payloads travel through shared memory instead (chosen
automatically, see :mod:`tensorfleet.wire.shared_memory`); the messages stay the same.

Why ROUTER/DEALER: the service can hold a request and answer it later (a worker waiting for
the chief to initialize the variables waits on the server, not in a polling loop), several
requests can be in flight on one channel, and ZeroMQ reconnects by itself.
"""

from __future__ import annotations

import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from tensorfleet.errors import (
    AuthenticationError,
    ClusterConfigError,
    ConfigError,
    ConnectionLost,
    DeadlineExceeded,
    ListenError,
    ProtocolError,
    RemoteError,
    ServiceRestarted,
    remote_error_class,
)
from tensorfleet.wire import message as wire
from tensorfleet.wire import shared_memory as shm
from tensorfleet.wire.auth import (
    REPLY_ROLE,
    REQUEST_ROLE,
    Buffer,
    MessageSigner,
    MessageVerifier,
    derive_curve_server_keys,
)

#: Messages a peer may have queued at a service before ZeroMQ stops reading from it.
RECEIVE_QUEUE_MESSAGES = 64
#: Invalid messages after which a connection is ignored (quarantined) for good.
QUARANTINE_AFTER_INVALID = 8
#: ZeroMQ's own connection heartbeat: a ping every this many ms; a connection silent for
#: ZMQ_HEARTBEAT_TIMEOUT_MS is closed and re-established (a cut link is noticed, not waited
#: on through TCP's minutes-long retransmission timeout).
ZMQ_HEARTBEAT_IVL_MS = 1000
ZMQ_HEARTBEAT_TIMEOUT_MS = 5000
#: A client send that cannot be queued for this long fails (a send never blocks forever).
SEND_TIMEOUT_MS = 10_000
#: Error code of the answer to a request addressed to an earlier incarnation of a service.
STALE_SESSION = ServiceRestarted.code
#: At most this many characters of a refusal's code are shown in the client's message.
MAX_CODE_CHARS = 64
#: How often a waiting client checks its abort condition (e.g. a ps silent for too long).
ABORT_CHECK_S = 0.25


class _StaleSession(ProtocolError):
    """A valid request addressed to another incarnation of this service."""


def check_resolvable(address: str, what: str) -> None:
    """Raise :class:`ClusterConfigError` when the host of ``address`` does not resolve
    (ZeroMQ would otherwise retry silently forever)."""
    host, _, port = address.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        raise ClusterConfigError(
            f"cannot resolve the host of {what} at {address!r}: {exc}. Fix the address in the "
            "cluster spec (a name this machine can resolve, or an IP address)"
        ) from None


def tcp_endpoint(address: str, bind: bool = False) -> str:
    """``host:port`` as a ZeroMQ TCP endpoint. IPv6 hosts come bracketed (``[::1]:2222``)."""
    host, _, port = address.rpartition(":")
    if bind and host in ("localhost",):
        host = "127.0.0.1"
    return f"tcp://{host}:{port}"


@dataclass
class Request:
    """A request received by a service, with what is needed to answer it."""

    peer: bytes
    op: str
    request_id: int
    body: dict[str, Any]
    buffers: list[Buffer]
    deadline: float
    """``time.monotonic()`` after which the requester no longer waits for the answer."""
    session_id: bytes
    reply_segment: object = None
    """Where the requester wants the reply's payload (its shared-memory segment), or None."""


class _SegmentUnavailable(ProtocolError):
    """An authentic request whose shared-memory payload cannot be mapped (stale, gone)."""

    def __init__(self, text: str, header: dict[str, Any]) -> None:
        super().__init__(text)
        self.header = header


@dataclass
class Reply:
    """A verified reply: its body and buffers."""

    body: dict[str, Any]
    buffers: list[Buffer] = field(default_factory=list)


def reply_header(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """The header of a successful answer to ``request``."""
    return {"re": request.request_id, "to": request.session_id, "ok": True, "body": body}


def failure_header(request: Request, error_type: str, text: str) -> dict[str, Any]:
    """The header of an error answer to ``request``. ``error_type`` is the refusal's *code*
    (a :class:`~tensorfleet.errors.RemoteError` subclass's ``code``); the client raises
    ``remote_error_class(code)`` with ``text`` in its message."""
    return {
        "re": request.request_id,
        "to": request.session_id,
        "ok": False,
        "body": {},
        "error_type": error_type,
        "error": text,
    }


class ServiceSocket:
    """The server end: binds, receives authenticated requests, sends signed replies.

    Single-threaded by design (a ZeroMQ socket belongs to one thread): the owner calls
    :meth:`receive` in its loop and :meth:`reply` with what it decided.
    """

    def __init__(
        self,
        address: str,
        secret: bytes,
        limits: wire.Limits | None = None,
        encrypt: bool = False,
        shared_memory: bool | None = None,
    ) -> None:
        self.limits = limits or wire.Limits()
        self.address = address
        self.encrypt = encrypt
        use_memory = shared_memory_wanted(shared_memory)
        self._peer_segments = shm.PeerSegments() if use_memory else None
        self._host = shm.host_identity() if use_memory else None
        self._context = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        _set_connection_heartbeats(self._socket)
        if encrypt:
            public, secret_key = derive_curve_server_keys(secret)
            self._socket.curve_secretkey = secret_key
            self._socket.curve_publickey = public
            self._socket.curve_server = True
        endpoint = tcp_endpoint(address, bind=True)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            hint = (
                "another process is using that port: stop it, or pick another port in the cluster spec"
                if exc.errno == zmq.EADDRINUSE
                else "check that the host in the cluster spec is an address of this machine"
            )
            raise ListenError(
                exc.errno, f"cannot listen on {address} ({endpoint}): {exc.strerror}; {hint}"
            ) from None
        self._signer = MessageSigner(secret, REPLY_ROLE)
        self._verifier = MessageVerifier(secret, REQUEST_ROLE)
        self._noticed: OrderedDict[bytes, None] = OrderedDict()
        self._invalid_by_peer: OrderedDict[bytes, int] = OrderedDict()
        self.rejected: Counter[str] = Counter()
        """Messages dropped, by reason (``auth``, ``protocol``, ``stale``, ``malformed``)."""
        self.last_valid_request_time = time.monotonic()

    @property
    def session_id(self) -> bytes:
        """This service's session: clients address their requests to it."""
        return self._signer.session_id

    def poll(self, timeout_s: float) -> bool:
        """Whether a message is waiting, after waiting up to ``timeout_s``."""
        return bool(self._socket.poll(max(0, int(timeout_s * 1000))))

    def receive(self) -> Request | None:
        """One request, or None when the waiting message was not acceptable (it is counted in
        :attr:`rejected`). Call after :meth:`poll` said a message waits."""
        frames = self._socket.recv_multipart(copy=False)
        peer = frames[0].bytes
        if self._invalid_by_peer.get(peer, 0) >= QUARANTINE_AFTER_INVALID:
            self.rejected["quarantined"] += 1  # a connection that sent garbage again and again
            return None
        payload = [f.buffer for f in frames[1:]]
        try:
            msg = wire.decode(
                payload,
                wire.KIND_REQUEST,
                self._verifier,
                self.limits,
                resolve=self._resolve_request if self._peer_segments is not None else None,
            )
            request = self._request_from(peer, msg)
        except _StaleSession as stale:
            # Authentic, but meant for the process this one replaced: tell the client to say
            # hello again at once, rather than leave it waiting for a deadline. Not counted
            # as invalid: every client of a restarted ps sends a few of these.
            self.rejected["stale"] += 1
            request = stale.args[1]
            self.fail(
                request,
                STALE_SESSION,
                f"{self.address} restarted since this client said hello; say hello again",
            )
            return None
        except _SegmentUnavailable as exc:
            # Authentic (its header verified), but its payload cannot be reached: say why.
            self.rejected["shm"] += 1
            request_id = exc.header.get("id")
            if isinstance(request_id, int):
                session = bytes(memoryview(payload[0])[4:20])
                stub = Request(peer, str(exc.header.get("op")), request_id, {}, [], 0.0, session)
                self.fail(stub, "ProtocolError", f"{exc} [service {self.address}]")
            return None
        except AuthenticationError as exc:
            self.rejected["auth"] += 1
            self._count_invalid(peer)
            self._notice_once(peer, "auth", f"{exc} [service {self.address}]")
            return None
        except ProtocolError as exc:
            reason = (
                "protocol"
                if wire.peek_protocol(payload) not in (None, wire.PROTOCOL_VERSION)
                else "malformed"
            )
            self.rejected[reason] += 1
            self._count_invalid(peer)
            if reason == "protocol":
                self._notice_once(peer, "protocol", str(exc))
            return None
        self.last_valid_request_time = time.monotonic()
        return request

    def _request_from(self, peer: bytes, msg: wire.Message) -> Request:
        header = msg.header
        op, request_id, body = header.get("op"), header.get("id"), header.get("body")
        timeout_ms, addressed_to = header.get("timeout_ms"), header.get("srv")
        if not isinstance(op, str) or not isinstance(request_id, int) or not isinstance(body, dict):
            raise ProtocolError("request header needs op (str), id (int) and body (map)")
        if not isinstance(timeout_ms, int) or not 0 <= timeout_ms <= 7 * 24 * 3600 * 1000:
            raise ProtocolError(
                f"request timeout_ms must be a non-negative int, got {timeout_ms!r}"
            )
        request = Request(
            peer=peer,
            op=op,
            request_id=request_id,
            body=body,
            buffers=msg.buffers,
            deadline=time.monotonic() + timeout_ms / 1000,
            session_id=msg.session_id,
            reply_segment=header.get("shm_reply") if self._peer_segments is not None else None,
        )
        if op != "hello" and addressed_to != self.session_id:
            # Addressed to an earlier incarnation of this service (or a replay from one).
            raise _StaleSession("request addressed to another service session", request)
        return request

    def reply(
        self, request: Request, body: dict[str, Any], buffers: list[Buffer] | None = None
    ) -> zmq.MessageTracker | None:
        """Answer ``request`` successfully. Buffers are sent without a copy and must stay
        unchanged until the returned tracker is done (None when the reply had no buffers or
        could not be queued)."""
        return self._send(request, reply_header(request, body), buffers or [])

    def fail(self, request: Request, error_type: str, text: str) -> None:
        """Answer ``request`` with a refusal: ``error_type`` is its code (e.g.
        ``IdentityInUse.code``), which the client raises as ``remote_error_class(code)``."""
        self._send(request, failure_header(request, error_type, text), [])

    def _send(
        self, request: Request, header: dict[str, Any], buffers: list[Buffer]
    ) -> zmq.MessageTracker | None:
        header, buffers, in_frames = self._place_reply(request, header, buffers)
        frames = wire.encode(wire.KIND_REPLY, header, buffers, self._signer, in_frames)
        tracked = bool(buffers) and in_frames
        try:
            tracker = self._socket.send_multipart(
                [request.peer, *frames], copy=False, flags=zmq.NOBLOCK, track=tracked
            )
        except zmq.Again:
            self.rejected["unsent_reply"] += 1
            return None
        return tracker if tracked else None

    def _resolve_request(self, header: dict[str, Any], sizes: list[int]) -> list[Buffer]:
        try:
            return self._peer_segments.buffers(header["shm"], sizes)
        except ProtocolError as exc:
            raise _SegmentUnavailable(str(exc), header) from None

    def _place_reply(
        self, request: Request, header: dict[str, Any], buffers: list[Buffer]
    ) -> tuple[dict[str, Any], list[Buffer], bool]:
        """The reply's header and buffers, and whether the buffers go in frames: into the
        requester's shared-memory segment when it offered one and they fit (then the buffers
        signed are the copies there); this service's host in answers to ``hello``."""
        if request.op == "hello" and self._host is not None:
            header = {**header, "host": self._host}
        if not buffers or request.reply_segment is None:
            return header, buffers, True
        try:
            placed = self._peer_segments.write(request.reply_segment, buffers)
        except ProtocolError:
            self.rejected["shm"] += 1
            placed = None
        if placed is None:
            # The caller may have given live values (replies_in_shared_memory said yes):
            # frames leave later, so they carry a copy.
            return header, [bytes(memoryview(b)) for b in buffers], True
        return {**header, "shm": {}}, placed, False

    def replies_in_shared_memory(self, request: Request) -> bool:
        """Whether a reply to ``request`` with buffers goes into the requester's shared memory
        (copied there before :meth:`reply` returns, so the buffers may change right after)."""
        return request.reply_segment is not None

    def _count_invalid(self, peer: bytes) -> None:
        """Count an invalid message of ``peer``; past the limit its connection is ignored."""
        self._invalid_by_peer[peer] = self._invalid_by_peer.get(peer, 0) + 1
        self._invalid_by_peer.move_to_end(peer)
        if len(self._invalid_by_peer) > 4096:
            self._invalid_by_peer.popitem(last=False)

    def _notice_once(self, peer: bytes, reason: str, text: str) -> None:
        if peer in self._noticed:
            return
        self._noticed[peer] = None
        if len(self._noticed) > 1024:
            self._noticed.popitem(last=False)
        try:
            self._socket.send_multipart(
                [peer, *wire.encode_notice(reason, text)], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError:
            pass  # the peer is gone or not reading; the notice was a courtesy

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket and its context, first giving queued replies up to ``linger_s``
        to leave (the last ``done`` must reach the last worker)."""
        self._socket.close(linger=int(linger_s * 1000))
        self._context.term()
        if self._peer_segments is not None:
            self._peer_segments.close()


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
    ) -> None:
        check_resolvable(address, peer_name)
        self._shared_memory_allowed = shared_memory_wanted(shared_memory)
        self._segments: shm.ClientSegments | None = None
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
        _set_connection_heartbeats(self._socket)
        if encrypt:
            server_public, _ = derive_curve_server_keys(secret)
            public, secret_key = zmq.curve_keypair()  # ephemeral, per connection
            self._socket.curve_serverkey = server_public
            self._socket.curve_publickey = public
            self._socket.curve_secretkey = secret_key
        # Connection events: a request in flight when its connection drops is lost (ZeroMQ
        # does not resend it, and its answer could not come back), so its wait ends at once.
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._disconnects = 0
        self._sent_at_disconnects: dict[int, int] = {}
        self._socket.connect(tcp_endpoint(address))
        self._signer = MessageSigner(secret, REQUEST_ROLE)
        self._verifier = MessageVerifier(secret, REPLY_ROLE, max_sessions=16)
        self._next_id = 0
        self._pending: dict[int, str] = {}
        self._arrived: dict[int, Reply | RemoteError] = {}
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
        stay unchanged until the reply has arrived."""
        self._next_id += 1
        request_id = self._next_id
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
            extra, placed = self._segments.headers(request_id, buffers, self._pending)
            header.update(extra)
            if placed is not None:
                buffers, in_frames = placed, False
        frames = wire.encode(wire.KIND_REQUEST, header, buffers, self._signer, in_frames)
        try:
            self._socket.send_multipart(frames, copy=False)
        except zmq.Again:
            raise DeadlineExceeded(
                f"cannot queue '{op}' for {self.peer_name} at {self.address} within "
                f"{SEND_TIMEOUT_MS / 1000:.0f} s: its send queue is full (unreachable for long?)"
            ) from None
        self.bytes_sent += payload_bytes + sum(memoryview(f).nbytes for f in frames[:3])
        self._pending[request_id] = op
        self._count_disconnects()
        self._sent_at_disconnects[request_id] = self._disconnects
        return request_id

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
        if request_id not in self._pending and request_id not in self._arrived:
            raise ConfigError(
                f"request {request_id} was not sent on this channel or was already awaited"
            )
        deadline = time.monotonic() + timeout_s
        while request_id not in self._arrived:
            remaining = deadline - time.monotonic()
            slice_s = remaining if abort is None else min(remaining, ABORT_CHECK_S)
            ready = dict(self._poller.poll(max(1, int(slice_s * 1000)))) if remaining > 0 else {}
            if self._socket in ready:
                self._receive_one()  # answers that arrived before a disconnect come first
                continue
            if self._monitor in ready:
                self._count_disconnects()
                if self._sent_at_disconnects.get(request_id, self._disconnects) < self._disconnects:
                    op = self._pending.pop(request_id, "?")
                    self._sent_at_disconnects.pop(request_id, None)
                    raise ConnectionLost(
                        f"the connection to {self.peer_name} at {self.address} dropped while "
                        f"'{op}' was in flight; the request or its answer is lost"
                        + (
                            ". It never answered: check that every task agrees on encryption "
                            "(TENSORFLEET_ENCRYPT / --encrypt)"
                            if self.server_session is None
                            else ""
                        )
                    )
                continue
            if remaining > 0:
                reason = abort() if abort is not None else None
                if reason is None:
                    continue
                op = self._pending.pop(request_id, "?")
                self._sent_at_disconnects.pop(request_id, None)
                raise ConnectionLost(
                    f"gave up waiting for {self.peer_name} at {self.address} to answer '{op}': {reason}"
                )
            if remaining <= 0:
                op = self._pending.pop(request_id, "?")
                self._sent_at_disconnects.pop(request_id, None)
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
        self._sent_at_disconnects.pop(request_id, None)
        outcome = self._arrived.pop(request_id)
        if isinstance(outcome, RemoteError):
            raise outcome
        return outcome

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
        frames = [f.buffer for f in self._socket.recv_multipart(copy=False)]
        notice = wire.decode_notice(frames)
        if notice is not None:
            if self.server_session is None:  # before the handshake, a notice explains a refusal
                raise wire.notice_error(notice, f"{self.peer_name} at {self.address}")
            self.dropped["notice"] += 1
            return
        try:
            msg = wire.decode(
                frames,
                wire.KIND_REPLY,
                self._verifier,
                self.limits,
                resolve=self._segments.resolve if self._segments is not None else None,
            )
        except (AuthenticationError, ProtocolError):
            self.dropped["invalid"] += 1
            return
        self.bytes_received += sum(memoryview(f).nbytes for f in frames[:3]) + sum(
            memoryview(b).nbytes for b in msg.buffers
        )
        header = msg.header
        self._note_reply_placement(header)
        re, to = header.get("re"), header.get("to")
        if to != self._signer.session_id or re not in self._pending:
            self.dropped["unexpected"] += 1
            return
        if header.get("ok") is True and isinstance(header.get("body"), dict):
            if self._pending[re] == "hello":
                self.server_session = msg.session_id
            self._arrived[re] = Reply(body=header["body"], buffers=msg.buffers)
        else:
            self._arrived[re] = self._refusal(header, self._pending[re])

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

    def _count_disconnects(self) -> None:
        """Take the connection events that arrived (without waiting)."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnects += 1

    def close(self) -> None:
        """Close the socket (and the context if this channel made it)."""
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        if self._own_context:
            self._context.term()
        if self._segments is not None:
            self._segments.close()
            self._segments = None


def shared_memory_wanted(choice: bool | None) -> bool:
    """``choice``, or (None) whether the environment and the system allow shared memory."""
    return shm.enabled() if choice is None else choice and shm.enabled()


def _set_connection_heartbeats(socket: zmq.Socket) -> None:
    """Let ZeroMQ ping the peer and drop a connection that stays silent (see the constants)."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, ZMQ_HEARTBEAT_TIMEOUT_MS)
