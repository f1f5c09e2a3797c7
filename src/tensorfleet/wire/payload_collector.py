"""The service's end of a payload stream's other direction: request payloads, read in order.

What. A client whose payload stream is open sends the payload of a large request on it
(:mod:`tensorfleet.wire.channel_stream`); the request's header goes over ZeroMQ with
``stream`` in it, as a streamed reply's does. The service's loop verifies the header, asks
the stream's :class:`PayloadCollector` for that payload (:meth:`PayloadCollector.expect`)
and goes on serving other clients. The collector's thread reads the payloads in the order
they were asked for, each in place into fresh memory and verified chunk by chunk against
the client's *request* key (the framing of :mod:`tensorfleet.wire.payload_stream`), and
calls ``wake`` when one is complete or failed, so that the loop serves the request then
(:mod:`tensorfleet.wire.held_requests` holds it, and the client's later requests, until
then).

Why a thread, and why the loop asks. Read by the loop itself, a payload would stop the
service for its whole transfer (8 MB take 64 ms at 1 Gb/s): every other client's request
would wait, and its transfer with it. ZeroMQ's own I/O thread receives while the loop works;
the collector does the same for the stream. The loop asks because only a verified header
names the payload's sizes: the collector allocates nothing an unauthenticated peer
announced and reads nothing an authentic header did not ask for (the bytes wait in the
kernel meanwhile, and the client's sender with them). The alternative, a preamble on the
stream naming the sizes, would need a tag of its own under a nonce no message uses, so that
the collector could read ahead of the header; the client sends the header first and it is
small, so it is normally in before the payload's first chunk and the ask delays nothing.

Failures. A payload that fails (altered, cut short, late: past the request's deadline,
at most :data:`~tensorfleet.wire.payload_stream.READ_TIMEOUT_S`) is done with its
error, and the stream is closed (its position cannot be trusted): the payloads asked for
later fail at once with :class:`~tensorfleet.errors.ConnectionLost`. The service answers
each such request with :class:`~tensorfleet.errors.PayloadStreamLost`: its client says
hello again, which opens a new stream, and sends the request again.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable, Sequence

from tensorfleet.errors import ConnectionLost, TensorfleetError
from tensorfleet.wire.payload_stream import PayloadReceiver

log = logging.getLogger(__name__)


class PendingPayload:
    """One request payload a collector was asked for: :attr:`done` once it was read and
    verified (:attr:`buffers`) or failed (:attr:`error`)."""

    def __init__(self, counter: int, sizes: Sequence[int], deadline: float) -> None:
        self.counter, self.sizes, self.deadline = counter, list(sizes), deadline
        self.buffers: list[memoryview] | None = None
        self.error: Exception | None = None
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, buffers: list[memoryview] | None, error: Exception | None) -> None:
        self.buffers, self.error = buffers, error
        self._done.set()

    def wait(self, timeout_s: float) -> bool:
        """Whether it is done within ``timeout_s`` (for tests and for a caller without a
        loop to wake)."""
        return self._done.wait(timeout_s)


class PayloadCollector:
    """Reads the request payloads of one client's stream on a thread of its own, in the order
    :meth:`expect` asked for them; ``wake()`` is called after each is done. ``conn`` is the
    collector's own socket object (the stream's sender holds another: a socket's timeout is
    per object), ``client_key`` the client's request key."""

    def __init__(
        self,
        conn: socket.socket,
        client_key: bytes,
        wake: Callable[[], None],
        peer: str = "a client",
    ) -> None:
        self._receiver = PayloadReceiver(conn, client_key, peer=peer)
        self._wake = wake
        self._queue: queue.SimpleQueue[PendingPayload | None] = queue.SimpleQueue()
        self._closed = False
        self.collected = 0
        """Payloads read and verified."""
        self._thread = threading.Thread(
            target=self._run, name="tensorfleet-stream-collector", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        return not self._closed and self._receiver.failure is None

    def expect(self, counter: int, sizes: Sequence[int], deadline: float) -> PendingPayload:
        """Ask for the payload of the request message ``counter`` (``sizes`` from its verified
        header), to arrive by ``deadline`` (``time.monotonic()``); its :class:`PendingPayload`,
        done later (at once with :class:`ConnectionLost` when the stream is closed)."""
        pending = PendingPayload(counter, sizes, deadline)
        if not self.alive:
            pending.finish(None, ConnectionLost(self._closed_reason()))
            return pending
        self._queue.put(pending)
        return pending

    def _closed_reason(self) -> str:
        return self._receiver.failure or (
            f"the payload stream from {self._receiver.peer} is closed (the client opened a new "
            "one, or the service is stopping)"
        )

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            if self._closed:
                pending.finish(None, ConnectionLost(self._closed_reason()))
            else:
                try:
                    buffers = self._receiver.receive(
                        pending.counter, pending.sizes, pending.deadline
                    )
                except TensorfleetError as exc:  # the request's error (see the module)
                    pending.finish(None, exc)
                except Exception as exc:  # a bug of ours: logged, and still the request's error
                    log.exception("the payload stream collector of %s failed", self._receiver.peer)
                    pending.finish(None, exc)
                else:
                    self.collected += 1
                    pending.finish(buffers, None)
            self._wake()

    def close(self) -> None:
        """Stop: a read in progress ends at once (its payload fails), later asks fail."""
        self._closed = True
        self._queue.put(None)
        self._receiver.close()
