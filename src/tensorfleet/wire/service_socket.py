"""The server end of request/reply over ZeroMQ: a :class:`ServiceSocket` binds, serves many
peers, receives authenticated :class:`Request` s and sends signed replies (or refusals).

Every request has an id and a deadline, every reply names the request it answers, and every
message is authenticated (see :mod:`tensorfleet.wire.message`). A service never crashes on
bad input: it drops and counts what it cannot accept, ignores a connection for good after
``QUARANTINE_AFTER_INVALID`` invalid messages, and tells a peer that cannot authenticate
(once) so that the peer fails with a clear error instead of a timeout. A request addressed to
an earlier incarnation of the service is refused with ``STALE_SESSION``.

The service can hold a request and answer it later (ROUTER socket; see
:mod:`tensorfleet.wire.transport` for what both ends share, and
:mod:`tensorfleet.wire.channel` for the client end).

With ``encrypt=True`` the socket answers key exchanges itself, opens sealed requests and
seals the replies to them (:mod:`tensorfleet.wire.encryption`); a request that was not
sealed is refused with ``EncryptionMismatch``, as is a key exchange without ``encrypt``.

Security events are logged, not only counted: a message dropped because it failed
authentication (a worker's ``hello`` with the wrong secret), was malformed, spoke another
protocol or did not match the encryption setting, and a connection quarantined, each make a
WARNING on the ``tensorfleet.security`` logger naming the service, the peer's IP address and
the count so far (:class:`RejectionLog`). At most one line per kind per
``REJECTION_LOG_INTERVAL_S``, so that a flood of junk cannot flood the log; nothing the peer
sent is logged but the count (the address is the kernel's, and sanitized anyway).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from typing import Any

import zmq

from tensorfleet import environment
from tensorfleet.errors import (
    AuthenticationError,
    ConnectionLost,
    EncryptionMismatch,
    ListenError,
    PayloadStreamLost,
    ProtocolError,
    RemoteProtocolError,
    ReplayedMessage,
    ServiceRestarted,
)
from tensorfleet.wire import message as wire
from tensorfleet.wire import service_streams, zmq_frames
from tensorfleet.wire import shared_memory as shm
from tensorfleet.wire.auth import (
    REPLY_ROLE,
    REQUEST_ROLE,
    Buffer,
    MessageSigner,
    MessageVerifier,
)
from tensorfleet.wire.encryption import KEY_EXCHANGE_OP, ServiceEncryption
from tensorfleet.wire.held_requests import HeldMessage, HeldRequests
from tensorfleet.wire.payload_collector import PendingPayload
from tensorfleet.wire.payload_stream import PayloadSender
from tensorfleet.wire.rejection_log import (
    QUARANTINE_AFTER_INVALID,
    RejectionLog,
    peer_address,
)
from tensorfleet.wire.service_request import Request, failure_header, reply_header
from tensorfleet.wire.transport import (
    set_connection_heartbeats,
    shared_memory_wanted,
    tcp_endpoint,
)

#: Messages a peer may have queued at a service before ZeroMQ stops reading from it.
RECEIVE_QUEUE_MESSAGES = 64
#: Error code of the answer to a request addressed to an earlier incarnation of a service.
STALE_SESSION = ServiceRestarted.code

log = logging.getLogger(__name__)


class _StaleSession(ProtocolError):
    """A valid request addressed to another incarnation of this service."""


class _SegmentUnavailable(ProtocolError):
    """An authentic request whose shared-memory payload cannot be mapped (stale, gone)."""

    def __init__(self, text: str, header: dict[str, Any]) -> None:
        super().__init__(text)
        self.header = header


def _claimed_session(frames: list[Buffer]) -> bytes | None:
    """The session an envelope claims (not verified: only to queue a message behind its
    session's held one, where it is verified in its turn), or None when there is none."""
    if not frames or memoryview(frames[0]).nbytes != wire.ENVELOPE_BYTES:
        return None
    return bytes(memoryview(frames[0])[4:20])


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
        payload_stream: bool | None = None,
    ) -> None:
        self.limits = limits or wire.Limits()
        self.address = address
        self.encrypt = encrypt
        use_memory = shared_memory_wanted(shared_memory)
        self._peer_segments = shm.PeerSegments() if use_memory else None
        self.streams: service_streams.ServiceStreams | None = None  # set once bound, below
        self._held = HeldRequests()
        """Requests whose payload is still on its stream, and their clients' later ones."""
        self._host = shm.host_identity() if use_memory else None
        self._context = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        set_connection_heartbeats(self._socket)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._held.fileno(), zmq.POLLIN)  # a streamed payload is in
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
        self._encryption = ServiceEncryption(secret, self._signer.session_id) if encrypt else None
        self.streams = self._start_streams(
            secret, service_streams.wanted() if payload_stream is None else payload_stream
        )
        """Large payloads over the clients' payload streams, both ways, when on
        (:mod:`tensorfleet.wire.service_streams`); None when off."""
        self._noticed: OrderedDict[bytes, None] = OrderedDict()
        self._invalid_by_peer: OrderedDict[bytes, int] = OrderedDict()
        self.rejected: Counter[str] = Counter()
        """Messages dropped, by reason (``auth``, ``protocol``, ``stale``, ``malformed``,
        ``unencrypted``: not sealed where the service encrypts, or the reverse;
        ``unknown_connection``: sealed under keys this service does not hold)."""
        self.shared_memory: Counter[str] = Counter(requests=0, replies=0)
        """Requests whose payload was read from the requester's shared memory
        (``requests``) and replies written into it (``replies``): the same-host path.
        Both keys are always there (0 over TCP), as ``cluster_stats()`` shows them."""
        self.last_valid_request_time = time.monotonic()
        self.rejection_log = RejectionLog(address)
        """Says in the log what :attr:`rejected` counts (rate-limited)."""
        self._quarantined_connections = 0
        self._frame: zmq.Frame | None = None
        """The first frame of the message being received: where its peer's address is."""

    @property
    def session_id(self) -> bytes:
        """This service's session: clients address their requests to it."""
        return self._signer.session_id

    def poll(self, timeout_s: float) -> bool:
        """Whether a message is waiting (or a held request can be served: its payload came
        in on its stream), after waiting up to ``timeout_s``."""
        if self._held.ready() or zmq_frames.readable(self._socket):  # no poll syscall then
            return True
        return bool(self._poller.poll(max(0, int(timeout_s * 1000))))

    def receive(self) -> Request | None:
        """One request, or None when none can be served now: the waiting message was not
        acceptable (it is counted in :attr:`rejected`), or is held until its payload (or
        its client's earlier request's payload) has come in on its payload stream
        (:mod:`tensorfleet.wire.held_requests`). Call after :meth:`poll` said one waits."""
        released = self._held.next_ready()
        if released is not None:
            held = released[1]
            self._frame = held.origin
            return self._take(held.peer, list(held.frames), held.payload)
        try:
            frames = zmq_frames.receive_frames(self._socket, zmq_frames.NOBLOCK)
        except zmq.Again:  # woken for a payload that is not done yet
            return None
        peer = frames[0].bytes
        self._frame = frames[0]  # the peer's address, for the log lines of a rejection
        if self._invalid_by_peer.get(peer, 0) >= QUARANTINE_AFTER_INVALID:
            self.rejected["quarantined"] += 1  # a connection that sent garbage again and again
            return None
        payload = [f.buffer for f in frames[1:]]
        session = _claimed_session(payload)
        if session is not None and self._held.holds(session):  # behind its session's payload
            if not self._held.hold(session, HeldMessage(peer, payload, None, frames[0])):
                self.rejected["held_overflow"] += 1
            return None
        return self._take(peer, payload, None)

    def _take(
        self, peer: bytes, payload: list[Buffer], streamed: PendingPayload | None
    ) -> Request | None:
        """Decode and check one message (its payload read from the stream as ``streamed``
        when that is done); the request, or None as :meth:`receive` says."""
        try:
            msg = wire.decode(
                payload,
                wire.KIND_REQUEST,
                self._verifier,
                self.limits,
                resolve=self._resolve_request if self._peer_segments is not None else None,
                openers=self._encryption.opener if self._encryption is not None else None,
                read_stream=lambda header, counter, sizes: self._request_payload(
                    payload, streamed, header, counter, sizes
                ),
            )
            request = self._request_from(peer, msg)
        except wire.UnknownConnection as exc:
            self.rejected["unknown_connection"] += 1
            self._count_invalid(peer)
            self._refuse_unknown_connection(peer, exc)
            return None
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
        except service_streams.PayloadPending as pending:  # served when its payload is in
            session = bytes(memoryview(payload[0])[4:20])  # verified by now
            self._held.hold(session, HeldMessage(peer, payload, pending.payload, self._frame))
            return None
        except service_streams.PayloadFailed as exc:
            self.rejected["stream"] += 1
            self._fail_stub(
                peer,
                payload,
                exc.header,
                PayloadStreamLost.code,
                f"the payload of this request did not arrive whole on its payload stream: {exc} "
                f"[service {self.address}]; say hello again (a new stream opens) and send it again",
            )
            return None
        except _SegmentUnavailable as exc:
            # Authentic (its header verified), but its payload cannot be reached: say why.
            self.rejected["shm"] += 1
            self._fail_stub(
                peer, payload, exc.header, "ProtocolError", f"{exc} [service {self.address}]"
            )
            return None
        except AuthenticationError as exc:
            # a replay is logged as its own kind: after a stop, a client's old connection
            # delivers requests it gave up on behind newer ones (not a secret problem)
            self._reject("replayed" if isinstance(exc, ReplayedMessage) else "auth")
            self._count_invalid(peer)
            self._notice_once(peer, "auth", f"{exc} [service {self.address}]")
            return None
        except ProtocolError as exc:
            reason = (
                "protocol"
                if wire.peek_protocol(payload) not in (None, wire.PROTOCOL_VERSION)
                else "malformed"
            )
            self._reject(reason)
            self._count_invalid(peer)
            if reason == "protocol":
                self._notice_once(peer, "protocol", str(exc))
            return None
        self.last_valid_request_time = time.monotonic()
        if wire.SHARED_MEMORY_KEY in msg.header:
            self.shared_memory["requests"] += 1
        if not msg.sealed and (self._encryption is not None or request.op == KEY_EXCHANGE_OP):
            self._answer_unsealed(request)
            return None
        return request

    def _fail_stub(
        self, peer: bytes, payload: list[Buffer], header: dict[str, Any], code: str, text: str
    ) -> None:
        """Refuse an authentic request that could not be made whole (its payload is out of
        reach), from its verified header."""
        request_id = header.get("id")
        if not isinstance(request_id, int):
            return
        session = bytes(memoryview(payload[0])[4:20])
        stub = Request(peer, str(header.get("op")), request_id, {}, [], 0.0, session)
        if self._encryption is not None:
            stub.sealer = self._encryption.sealer(session)
        self.fail(stub, code, text)

    def _request_payload(
        self,
        payload: list[Buffer],
        streamed: PendingPayload | None,
        header: dict[str, Any],
        counter: int,
        sizes: list[int],
    ) -> list[memoryview]:
        """``wire.decode``'s ``read_stream`` for a request (see
        :meth:`~tensorfleet.wire.service_streams.ServiceStreams.request_payload`)."""
        session = bytes(memoryview(payload[0])[4:20])  # the header verified: authentic
        if self.streams is None:
            raise service_streams.PayloadFailed(
                ConnectionLost("this service has no payload streams"), header
            )
        return self.streams.request_payload(session, streamed, header, counter, sizes)

    def _answer_unsealed(self, request: Request) -> None:
        """A request that was not sealed where it must be (or a key exchange where nothing
        is sealed): refused with ``EncryptionMismatch`` naming the flag; or a key exchange,
        answered with this service's public key."""
        if self._encryption is None:
            self._reject("unencrypted")
            self.fail(
                request,
                EncryptionMismatch.code,
                f"the service at {self.address} does not encrypt its traffic (started without "
                "--encrypt) and this client does (--encrypt / TENSORFLEET_ENCRYPT=1): every task "
                "of a cluster must agree; start the service with --encrypt, or the client without",
            )
        elif request.op != KEY_EXCHANGE_OP:
            self._reject("unencrypted")
            self.fail(
                request,
                EncryptionMismatch.code,
                f"the service at {self.address} encrypts its traffic (started with --encrypt) and "
                "this client does not: set TENSORFLEET_ENCRYPT=1 on every task of the cluster "
                "(`tensorfleet launch --encrypt` sets it; `tensorfleet server` and the examples "
                "also take --encrypt)",
            )
        else:
            try:
                public = self._encryption.answer(request.session_id, request.body.get("public_key"))
            except ProtocolError as exc:
                self.fail(request, RemoteProtocolError.code, f"{exc} [service {self.address}]")
                return
            self._send(request, reply_header(request, {"public_key": public}), [])

    def _refuse_unknown_connection(self, peer: bytes, exc: wire.UnknownConnection) -> None:
        """Answer a sealed request this service holds no keys for (it restarted, or forgot the
        connection) with a signed ``StaleSession`` refusal naming its counter (its id is
        sealed), so that the client exchanges keys and says hello again at once."""
        header = {
            "re": None,
            "re_counter": exc.counter,
            "to": exc.session_id,
            "ok": False,
            "body": {},
            "error_type": STALE_SESSION,
            "error": f"{self.address} holds no keys for this connection (it restarted, or "
            "forgot the connection): exchange keys and say hello again",
        }
        frames = wire.encode(wire.KIND_REPLY, header, [], self._signer)
        try:
            self._socket.send_multipart([peer, *frames], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.rejected["unsent_reply"] += 1

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
            sealer=(
                self._encryption.sealer(msg.session_id)
                if msg.sealed and self._encryption is not None
                else None
            ),
        )
        if op == "hello" and self._peer_segments is not None and "shm_probe" in header:
            request.shared_memory_refused = shm.probe(header["shm_probe"])
        if op not in ("hello", KEY_EXCHANGE_OP) and addressed_to != self.session_id:
            # Addressed to an earlier incarnation of this service (or a replay from one).
            raise _StaleSession("request addressed to another service session", request)
        return request

    def reply(
        self, request: Request, body: dict[str, Any], buffers: list[Buffer] | None = None
    ) -> zmq.MessageTracker | None:
        """Answer ``request`` successfully. The returned tracker is done once the reply has
        left (None when it had no buffers in frames, or could not be queued). Buffers are
        sent without a copy and must stay unchanged until then, unless
        :meth:`reply_copies_buffers` says they are copied (or encrypted) before this
        returns."""
        return self._send(request, reply_header(request, body), buffers or [])

    def fail(self, request: Request, error_type: str, text: str) -> None:
        """Answer ``request`` with a refusal: ``error_type`` is its code (e.g.
        ``IdentityInUse.code``), which the client raises as ``remote_error_class(code)``."""
        self._send(request, failure_header(request, error_type, text), [])

    def _start_streams(self, secret: bytes, wanted: bool) -> service_streams.ServiceStreams | None:
        if not wanted:
            return None
        try:
            return service_streams.ServiceStreams(
                self.address, secret, self._signer, self._held.wake, service=self.address
            )
        except OSError as exc:
            port = service_streams.listen_port()
            variable = environment.PAYLOAD_STREAM_PORT_VAR
            log.warning(
                "tensorfleet service %s: cannot listen for payload streams on %s (%s): every "
                "payload stays on ZeroMQ%s",
                self.address,
                f"port {port} ({variable})" if port else "a free port",
                exc,
                f"; free port {port}, or set {variable} to another port (0: any free one)"
                if port
                else "",
            )
            return None

    def _send(
        self, request: Request, header: dict[str, Any], buffers: list[Buffer]
    ) -> zmq.MessageTracker | service_streams.StreamTracker | None:
        stream = self._stream_for(request, header, buffers)
        if stream is not None:
            header, in_frames = {**header, wire.STREAM_KEY: {}}, False
        else:
            header, buffers, in_frames = self._place_reply(request, header, buffers)
        frames = wire.encode(
            wire.KIND_REPLY, header, buffers, self._signer, in_frames, sealer=request.sealer
        )
        tracked = bool(buffers) and in_frames
        try:
            tracker = zmq_frames.send_frames(
                self._socket, [request.peer, *frames], zmq_frames.NOBLOCK, track=tracked
            )
        except zmq.Again:
            self.rejected["unsent_reply"] += 1
            return None
        if stream is not None:  # the payload follows its header, on the client's stream
            streamed = service_streams.StreamTracker()
            stream.send(self._signer.counter, buffers, streamed.finish)
            self.streams.sent += 1  # type: ignore[union-attr]
            return streamed
        return tracker if tracked else None

    def _stream_for(
        self, request: Request, header: dict[str, Any], buffers: list[Buffer]
    ) -> PayloadSender | None:
        """The client's payload stream when this reply's payload takes it (see
        :mod:`tensorfleet.wire.service_streams`), else None."""
        if (
            self.streams is None
            or not buffers
            or request.reply_segment is not None
            or request.sealer is not None
            or header.get("ok") is not True
        ):
            return None
        return self.streams.sender_for(
            request.session_id, sum(memoryview(b).nbytes for b in buffers)
        )

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
        signed are the copies there); this service's host in answers to ``hello``, and why
        it cannot reach the requester's shared memory when its probe failed."""
        if request.op == "hello" and self.streams is not None:
            header = {**header, "stream_port": self.streams.port}
        if request.op == "hello" and self._host is not None:
            header = {**header, "host": self._host}
            if request.shared_memory_refused is not None:
                header["shm_refused"] = request.shared_memory_refused
        if not buffers or request.reply_segment is None:
            return header, buffers, True
        try:
            placed = self._peer_segments.write(request.reply_segment, buffers)
        except ProtocolError:
            self.rejected["shm"] += 1
            placed = None
        if placed is None:
            # The caller may have given live values (reply_copies_buffers said yes): frames
            # leave later, so they carry a copy (sealed ones are one: the ciphertext).
            if request.sealer is None:
                buffers = [bytes(memoryview(b)) for b in buffers]
            return header, buffers, True
        self.shared_memory["replies"] += 1
        return {**header, wire.SHARED_MEMORY_KEY: {}}, placed, False

    def reply_copies_buffers(self, request: Request) -> bool:
        """Whether a reply to ``request`` copies its buffers before :meth:`reply` returns, so
        that they may change right after (the caller may give live values): into the
        requester's shared memory, or encrypted into a buffer of the socket's."""
        return request.reply_segment is not None or request.sealer is not None

    @property
    def encrypted_connections(self) -> int:
        """How many client connections this socket holds encryption keys for."""
        return 0 if self._encryption is None else self._encryption.connections

    def _reject(self, reason: str) -> None:
        """Count a message dropped for ``reason`` and say so in the log (rate-limited)."""
        self.rejected[reason] += 1
        if self.rejection_log.due(reason):
            self.rejection_log.rejected(reason, peer_address(self._frame), self.rejected[reason])

    def _count_invalid(self, peer: bytes) -> None:
        """Count an invalid message of ``peer``; past the limit its connection is ignored."""
        self._invalid_by_peer[peer] = self._invalid_by_peer.get(peer, 0) + 1
        self._invalid_by_peer.move_to_end(peer)
        if len(self._invalid_by_peer) > 4096:
            self._invalid_by_peer.popitem(last=False)
        if self._invalid_by_peer[peer] == QUARANTINE_AFTER_INVALID:
            self._quarantined_connections += 1
            if self.rejection_log.due("quarantine"):
                self.rejection_log.quarantined(
                    peer_address(self._frame), self._quarantined_connections
                )

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
        to leave (the last ``done`` must reach the last worker), their streamed payloads
        too (a preempted ps ends right after its reply to the chief's ``save``)."""
        deadline = time.monotonic() + linger_s
        if self.streams is not None:
            self.streams.stop_after_queued()  # they leave meanwhile, on their own threads
        self._socket.close(linger=int(linger_s * 1000))
        self._context.term()
        if self._peer_segments is not None:
            self._peer_segments.close()
        if self.streams is not None:
            self.streams.close(max(0.0, deadline - time.monotonic()))
        self._held.close()
