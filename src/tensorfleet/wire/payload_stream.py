"""Large payloads over a plain TCP stream beside the ZeroMQ socket, received in place.

What. A client keeps one TCP connection to each service (the *stream*) beside its ZeroMQ
socket. The service sends a large reply's header on ZeroMQ, authenticated as every message
is (it names the payload's sizes), and the payload on the stream: 1 MiB chunks
(:data:`~tensorfleet.wire.auth.CHUNK_BYTES`), each tagged just before it is sent (the next
chunk is tagged while this one travels), received with ``recv_into`` straight into memory
that becomes the caller's tensors and verified while the next chunk arrives. Nothing is
copied after the kernel's copy, and the MACs overlap the transfer.

Why. One ZeroMQ message per payload runs its MACs in turn with the transfer: the sender tags
every chunk before the first byte leaves, the receiver verifies after the last arrived.
Cut into one ZeroMQ message per chunk, the MACs overlap, but each chunk arrives in a message
of its own, which a model larger than a chunk cannot adopt as its memory: it must be copied.
Measured on this project's 2-core machine (``benchmarks/wire_floor.py``, 2026-11-28 15:19,
idle; docs/wire-performance.md, "The pull's floor"), an authenticated pull of 8 / 32 MB
against a raw TCP echo: one ZeroMQ message, adopted without a copy (tensorfleet's way until
now) 0.70x / 0.57x; one ZeroMQ message per chunk, copied 0.81x / 0.90x; a plain socket
received in place 1.43x / 1.41x. The data-plane target is 0.9x. ZeroMQ keeps the headers
and every small message: its queues, reconnection and identities are what the channel is
built on.

The opening. A client connects to the service's stream port (the service names it in its
answer to ``hello``) and sends, within :data:`OPENING_TIMEOUT_S`::

    magic "TFPS" | version u8 | client session id (16) | counter u64 | tag (16)

The tag is the client's message tag (:meth:`MessageSigner.tag`, its *request* key, the
counter as nonce) over the fields before it and the service's session id: only a holder of
the cluster secret can open a stream, an opening is never accepted twice (the listener's
:class:`~tensorfleet.wire.auth.MessageVerifier` refuses a counter not above the last one it
saw from that session, the rule of every message), and an opening meant for an earlier
process of the service fails here. The service answers one byte (:data:`OPENED`), sent by
the connection's :class:`PayloadSender` before anything else once the service holds it (so a
client that read it knows that its replies' payloads take the stream from then on), and the
connection then carries the payloads of the replies to that client session, in the order
the replies are sent.

Both directions. The stream carries the payloads of large replies from the service and,
the other way, of large requests from the client (the service's side reads those with
:class:`~tensorfleet.wire.payload_collector.PayloadCollector`). Each direction is framed
the same way, tagged under its sender's key: the service's *reply* key, the client's
*request* key.

A payload. Its chunks (:func:`~tensorfleet.wire.auth.chunk_spans` of the sizes the header
gave), in order, each::

    counter u64 | index u32 | length u32 | tag (16) | length bytes

``counter`` is the message's (its header came over ZeroMQ), ``index`` the chunk's
(1, 2, ...), ``tag`` its GMAC under the sender's key (the service's *reply* key, the
client's *request* key) with nonce ``index || counter``: the tag protocol 2 puts in a
message's chunk-tag frame, so a chunk moved to another message, another position, another
session or the other direction fails it. The receiver checks the
counter, index and length against what it expects before it reads the bytes, and hands
nothing out before every chunk verified.

Failures. A chunk that fails its tag is :class:`~tensorfleet.errors.AuthenticationError`, a
chunk of another message or the wrong length :class:`~tensorfleet.errors.ProtocolError`;
either way the stream is dropped (its position can no longer be trusted). A stream that
ends early is :class:`~tensorfleet.errors.ConnectionLost` naming the bytes received, a
payload that does not arrive within its deadline
:class:`~tensorfleet.errors.DeadlineExceeded`. A sender whose receiver stops reading gives up
after :data:`SEND_TIMEOUT_S` and tells every payload it held that it was not sent.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tensorfleet.errors import (
    AuthenticationError,
    ConnectionLost,
    DeadlineExceeded,
    ProtocolError,
)
from tensorfleet.wire.auth import (
    SESSION_ID_BYTES,
    TAG_BYTES,
    Buffer,
    MessageSigner,
    MessageVerifier,
    bytes_view,
    chunk_spans,
    gmac_matches,
    nonce,
)

log = logging.getLogger(__name__)

MAGIC = b"TFPS"
#: The version of the stream's opening and framing. 2: request payloads too (client to
#: service).
STREAM_VERSION = 2
_OPENING = struct.Struct(f">4sB{SESSION_ID_BYTES}sQ{TAG_BYTES}s")
OPENING_BYTES = _OPENING.size
_SIGNED_OPENING_BYTES = OPENING_BYTES - TAG_BYTES
#: What the service answers to an opening it accepted.
OPENED = b"\x01"
_CHUNK_HEADER = struct.Struct(f">QII{TAG_BYTES}s")
CHUNK_HEADER_BYTES = _CHUNK_HEADER.size
#: Seconds a connection may take to send its opening before the service closes it.
OPENING_TIMEOUT_S = 5.0
#: Seconds a sender waits for its receiver to take more bytes before it gives the stream up.
SEND_TIMEOUT_S = 30.0
#: Seconds a streamed payload may take to arrive once its header is in (at most: a
#: request's own deadline is shorter when it says so).
READ_TIMEOUT_S = 60.0
#: Openings read at once; a connection beyond them is closed at once (a flood of
#: connections costs the service no more threads than this).
MAX_PENDING_OPENINGS = 64


def _signed_opening(session_id: bytes, counter: int) -> bytes:
    return _OPENING.pack(MAGIC, STREAM_VERSION, session_id, counter, b"\0" * TAG_BYTES)[
        :_SIGNED_OPENING_BYTES
    ]


def open_stream(
    host: str, port: int, signer: MessageSigner, service_session: bytes, timeout_s: float
) -> socket.socket:
    """Connect to a service's stream port and open the stream of ``signer``'s session (the
    client's ZeroMQ session); the connected socket, ready to receive payloads. Raises
    :class:`ConnectionLost` when nothing listens there, :class:`DeadlineExceeded` when the
    service does not answer in ``timeout_s``, :class:`AuthenticationError` when it refuses."""
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        raise DeadlineExceeded(
            f"no connection to the payload stream at {where} within {timeout_s:.1f} s: check "
            "that the service's host accepts connections on that port (a firewall?)"
        ) from None
    except OSError as exc:
        raise ConnectionLost(
            f"cannot connect to the payload stream at {where}: {exc.strerror or exc}; check "
            "that the service is running and its host accepts connections on that port"
        ) from None
    try:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        counter = signer.next_counter()
        signed = _signed_opening(signer.session_id, counter)
        conn.sendall(signed + signer.tag(counter, [signed, service_session]))
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        answer = conn.recv(1)
    except TimeoutError:
        conn.close()
        raise DeadlineExceeded(
            f"the payload stream at {where} did not answer its opening within {timeout_s:.1f} s"
        ) from None
    except OSError as exc:
        conn.close()
        raise ConnectionLost(
            f"the payload stream at {where} dropped during its opening: {exc.strerror or exc}"
        ) from None
    if answer != OPENED:
        conn.close()
        raise AuthenticationError(
            f"the payload stream at {where} refused its opening (answered {answer!r}): the "
            "service does not hold this cluster's secret, or restarted since the hello"
        )
    conn.settimeout(None)
    return conn


class StreamListener:
    """The service's side of the openings: a listening socket on ``host`` and ``port`` (0: a
    free port; :attr:`port` names the one bound) and a thread that accepts connections,
    checks each opening with ``verifier`` against ``service_session`` and hands each
    accepted connection to ``on_open(client_session_id, connection)``, which answers
    :data:`OPENED` (a ``PayloadSender(..., greeting=OPENED)`` does, before any payload). A
    connection whose opening is late, malformed or not authentic is closed and counted in
    :attr:`rejected`; the listener goes on. ``verifier`` is the listener's own (``MessageVerifier(secret, "request")``),
    not the one of the service's ZeroMQ socket, which its thread uses unlocked: it
    remembers the openings' counters, so an opening is accepted once."""

    def __init__(
        self,
        host: str,
        verifier: MessageVerifier,
        service_session: bytes,
        on_open: Callable[[bytes, socket.socket], None],
        port: int = 0,
    ) -> None:
        self._verifier, self._service_session, self._on_open = verifier, service_session, on_open
        self._verifier_lock = threading.Lock()
        self._socket = socket.create_server((host, port), backlog=64)
        self._socket.settimeout(0.25)  # the accept loop looks at ``_closing`` this often
        self.port: int = self._socket.getsockname()[1]
        self.rejected = 0
        self._openings = threading.BoundedSemaphore(MAX_PENDING_OPENINGS)
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._accept_loop, name="tensorfleet-stream-listener", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # closed, or out of file descriptors for a moment
                if self._closing.is_set():
                    return
                log.warning("payload stream listener: accept failed (%s); trying again", exc)
                self._closing.wait(0.1)
                continue
            if not self._openings.acquire(blocking=False):
                self._count_rejection()
                conn.close()
                continue
            threading.Thread(
                target=self._open, args=(conn,), name="tensorfleet-stream-opening", daemon=True
            ).start()

    def _open(self, conn: socket.socket) -> None:
        """Read and check one opening; hand the connection over or close it."""
        try:
            conn.settimeout(OPENING_TIMEOUT_S)
            opening = _receive_exactly(conn, OPENING_BYTES)
            magic, version, session_id, counter, tag = _OPENING.unpack(opening)
            if magic != MAGIC or version != STREAM_VERSION:
                raise ProtocolError(f"not a payload stream's opening ({magic!r}, {version})")
            with self._verifier_lock:
                verified = self._verifier.check(
                    session_id,
                    counter,
                    tag,
                    [opening[:_SIGNED_OPENING_BYTES], self._service_session],
                )
                self._verifier.accept(verified, b"", [])
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, ProtocolError, AuthenticationError, _StreamEnded) as exc:
            self._count_rejection()
            log.debug("payload stream opening refused: %s", exc)
            conn.close()
            return
        finally:
            self._openings.release()
        self._on_open(session_id, conn)

    def _count_rejection(self) -> None:
        with self._verifier_lock:  # openings are read on threads of their own
            self.rejected += 1

    def close(self) -> None:
        self._closing.set()
        self._socket.close()
        self._thread.join(timeout=5)


@dataclass
class _Payload:
    counter: int
    buffers: Sequence[Buffer]
    on_done: Callable[[bool], None]


class PayloadSender:
    """The sending end of one stream's direction (the service's replies, a client's
    requests): payloads queued by :meth:`send` leave in order on a thread of their own, each
    chunk tagged with ``signer`` just before it goes (the sender's owner goes on meanwhile).
    ``on_done(sent)`` is called once per payload from that thread: True when its last byte
    was handed to the kernel (the buffers may change from then on), False when the stream
    failed first (then the payloads still queued are told False too, and later :meth:`send`
    calls at once). ``conn`` is the sender's own socket object (``dup()`` of the stream's
    when the other direction is read through it too: a socket's timeout is per object); the
    sender closes it when its thread ends."""

    def __init__(
        self,
        conn: socket.socket,
        signer: MessageSigner,
        peer: str = "client",
        greeting: bytes = b"",
        start: bool = True,
    ) -> None:
        self._conn, self._signer, self.peer = conn, signer, peer
        self._greeting = greeting
        """Sent first, on the sender's thread (:data:`OPENED` for a stream just opened)."""
        self._conn.settimeout(SEND_TIMEOUT_S)
        self._queue: queue.SimpleQueue[_Payload | None] = queue.SimpleQueue()
        self.failure: str | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="tensorfleet-stream-sender", daemon=True
        )
        if start:
            self._thread.start()

    def start(self) -> None:
        """Start sending (the greeting first), for a sender made with ``start=False``: its
        owner registers it first, so that a client that read the greeting finds its replies'
        payloads taking the stream."""
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.failure is None

    def send(
        self, counter: int, buffers: Sequence[Buffer], on_done: Callable[[bool], None]
    ) -> None:
        """Queue the payload of the reply message ``counter``; the buffers must stay
        unchanged until ``on_done`` is called (at once, False, after a failure or
        :meth:`close`)."""
        if self.failure is not None or self._closed:
            on_done(False)
            return
        self._queue.put(_Payload(counter, buffers, on_done))

    def _run(self) -> None:
        try:
            self._send_queued()
        finally:
            self._conn.close()  # the sender's own socket object (a stream's other user holds its own)

    def _send_queued(self) -> None:
        if self._greeting:
            try:
                self._conn.sendall(self._greeting)
            except OSError as exc:
                self.failure = f"the stream to {self.peer} failed: {exc.strerror or exc}"
        while True:
            payload = self._queue.get()
            if payload is None:
                return
            if self.failure is None:
                try:
                    self._send_one(payload)
                except OSError as exc:
                    self.failure = f"the stream to {self.peer} failed: {exc.strerror or exc}"
                    log.warning("%s", self.failure)
                    _shut_down(self._conn)  # the peer learns at once: its reads end
            payload.on_done(self.failure is None)

    def _send_one(self, payload: _Payload) -> None:
        views = [bytes_view(b) for b in payload.buffers]
        for index, (b, start, stop) in enumerate(chunk_spans([v.nbytes for v in views]), 1):
            chunk = views[b][start:stop]
            tag = self._signer.chunk_tag(payload.counter, index, chunk)
            header = _CHUNK_HEADER.pack(payload.counter, index, stop - start, tag)
            self._conn.sendall(header, socket.MSG_MORE)
            self._conn.sendall(chunk)

    def stop_after_queued(self) -> None:
        """Take no more payloads; the thread ends once those queued so far have left (each
        still told whether it was sent). Returns at once: :meth:`close` waits."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)

    def close(self, linger_s: float = SEND_TIMEOUT_S + 5) -> None:
        """Stop after the payloads queued so far, giving them up to ``linger_s`` to leave;
        past it (at once with 0) the connection is shut down, so the thread ends within a
        chunk, telling the rest they were not sent."""
        self.stop_after_queued()
        if self._thread.ident is None:  # never started: nothing was sent
            self._conn.close()
            return
        if linger_s > 0 and threading.current_thread() is not self._thread:
            self._thread.join(timeout=linger_s)
        if self._thread.is_alive():
            try:
                self._conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed or reset: the thread sees that too


def _shut_down(conn: socket.socket) -> None:
    """End the connection both ways (every socket object on it sees it), then close this
    object."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected any more
    conn.close()


class _StreamEnded(Exception):
    """The peer closed the stream after ``args[0]`` bytes of what was being read."""


def _receive_exactly(conn: socket.socket, count: int) -> bytearray:
    data = bytearray(count)
    _receive_into(conn, memoryview(data))
    return data


def _receive_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        received = conn.recv_into(view[got:])
        if not received:
            raise _StreamEnded(got)
        got += received


class PayloadReceiver:
    """The receiving end of one stream's direction: :meth:`receive` reads the payload of the
    message with a given counter into fresh memory, verifying each chunk against the
    sender's key ``peer_key`` (the service's reply key at a client, the client's request key
    at the service) while the next one arrives."""

    def __init__(self, conn: socket.socket, peer_key: bytes, peer: str = "the service") -> None:
        self._conn, self._aead, self.peer = conn, AESGCM(peer_key), peer
        self.failure: str | None = None

    def receive(self, counter: int, sizes: Sequence[int], deadline: float) -> list[memoryview]:
        """The buffers of the payload of message ``counter`` (of ``sizes`` bytes, as its
        authenticated header said), each verified, in memory the caller then owns (tensors
        may adopt it). Raises as the module says; after any failure the stream is closed and
        every later call raises :class:`ConnectionLost`."""
        buffers = [memoryview(torch.empty(n, dtype=torch.uint8).numpy()) for n in sizes]
        self._read(counter, sizes, deadline, buffers, verify=True)
        return buffers

    def skip(self, counter: int, sizes: Sequence[int], deadline: float) -> None:
        """Read past the payload of message ``counter`` without keeping it (the reply of a
        request nobody waits for any more), so that the next payload can be read."""
        scratch = memoryview(torch.empty(max(sizes, default=0), dtype=torch.uint8).numpy())
        self._read(counter, sizes, deadline, [scratch[:n] for n in sizes], verify=False)

    def _read(
        self,
        counter: int,
        sizes: Sequence[int],
        deadline: float,
        buffers: list[memoryview],
        verify: bool,
    ) -> None:
        if self.failure is not None:
            raise ConnectionLost(self.failure)
        header = bytearray(CHUNK_HEADER_BYTES)
        spans = chunk_spans(sizes)
        read = 0
        try:
            for index, (b, start, stop) in enumerate(spans, 1):
                self._conn.settimeout(max(0.001, deadline - time.monotonic()))
                _receive_into(self._conn, memoryview(header))
                got_counter, got_index, length, tag = _CHUNK_HEADER.unpack(header)
                if (got_counter, got_index, length) != (counter, index, stop - start):
                    raise self._fail(
                        ProtocolError(
                            f"the payload stream from {self.peer} sent chunk {got_index} of "
                            f"message {got_counter} ({length} bytes) where chunk {index} of "
                            f"message {counter} ({stop - start} bytes) was expected"
                        )
                    )
                chunk = buffers[b][start:stop]
                try:
                    _receive_into(self._conn, chunk)
                except _StreamEnded as ended:
                    raise _StreamEnded(read + ended.args[0]) from None
                read += stop - start
                if verify and not gmac_matches(
                    self._aead, nonce(counter, index), bytes(tag), chunk
                ):
                    raise self._fail(
                        AuthenticationError(
                            f"payload authentication failed in chunk {index} of {len(spans)} "
                            f"from {self.peer}: the payload was altered (or the sender does "
                            "not hold this cluster's secret)"
                        )
                    )
        except TimeoutError:
            raise self._fail(
                DeadlineExceeded(
                    f"the payload of message {counter} from {self.peer} did not arrive in time "
                    f"({read} of {sum(sizes)} bytes)"
                )
            ) from None
        except _StreamEnded as ended:
            raise self._fail(
                ConnectionLost(
                    f"the payload stream from {self.peer} ended after "
                    f"{max(read, ended.args[0])} of the {sum(sizes)} bytes of message "
                    f"{counter}'s payload (its sender closed it, or died)"
                )
            ) from None
        except OSError as exc:
            raise self._fail(
                ConnectionLost(f"the payload stream from {self.peer} failed: {exc.strerror or exc}")
            ) from None

    def _fail(self, error: Exception) -> Exception:
        """Close the stream (its position cannot be trusted after a failure) and remember
        why; the error to raise."""
        self.failure = f"the payload stream from {self.peer} is closed after an error: {error}"
        self.close()  # both directions: the peer learns at once that the stream is gone
        return error

    def close(self) -> None:
        """Close the stream; a read blocked in another thread ends at once (the connection
        is shut down first: closing alone would not wake it)."""
        _shut_down(self._conn)
