"""A :class:`~tensorfleet.wire.service_socket.ServiceSocket` served from a thread of its own:
the shared base of the patterns' small servers
(:class:`~tensorfleet.patterns.broadcast.WeightPublisher`,
:class:`~tensorfleet.patterns.actor_learner.SampleQueueServer`).

Rule. The constructor returns only once the socket is bound: it raises what binding raised
(the address is taken, say), or :class:`~tensorfleet.errors.DeadlineExceeded` when the
thread did not bind within ``START_TIMEOUT_S``; a server that exists is serving. The thread
alone owns the socket (a ZeroMQ socket belongs to one thread): every ``tick_s`` it answers
every request that arrived (:meth:`ServeThread._handle_request`), then does the server's
work of the tick (:meth:`ServeThread._after_tick`: answering held requests).

Invariant. The socket is closed when the thread ends, whatever ended it; an exception in the
serving thread is kept in ``_failure`` for the server's public methods to report, never
lost; :meth:`ServeThread.close` returns within ``JOIN_TIMEOUT_S``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

from tensorfleet.errors import DeadlineExceeded
from tensorfleet.wire.service_socket import Request, ServiceSocket

#: How long a constructor waits for its thread to bind the socket.
START_TIMEOUT_S = 30.0
#: How long :meth:`ServeThread.close` waits for the thread to end.
JOIN_TIMEOUT_S = 10.0


class ServeThread(ABC):
    """Serves a socket from a daemon thread; a subclass calls :meth:`_start_serving` at the
    end of its constructor and says what a request and a tick do."""

    def _start_serving(
        self, address: str, secret: bytes, *, encrypt: bool, name: str, what: str, tick_s: float
    ) -> None:
        """Start the thread that binds ``address`` and serves it; return once it is bound.
        ``name`` names the thread, ``what`` the server in messages (``the sample queue``)."""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(
            target=self._serve, args=(address, secret, encrypt, tick_s), name=name, daemon=True
        )
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise DeadlineExceeded(
                f"{what} at {address} did not start within {START_TIMEOUT_S:g} s"
            )
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Stop serving (peers waiting for an answer get an error on their side)."""
        self._stop.set()
        self._thread.join(timeout=JOIN_TIMEOUT_S)

    @abstractmethod
    def _handle_request(self, service: ServiceSocket, request: Request) -> None:
        """Answer ``request``, or hold it for :meth:`_after_tick` (serving thread)."""

    @abstractmethod
    def _after_tick(self, service: ServiceSocket) -> None:
        """The server's work after each tick's requests, e.g. answering held ones."""

    def _on_failure(self) -> None:
        """Called in the serving thread after an exception was recorded in ``_failure``
        (to wake up whoever waits on the server)."""
        return None  # by default nobody waits on the serving thread

    def _serve(self, address: str, secret: bytes, encrypt: bool, tick_s: float) -> None:
        try:
            service = ServiceSocket(address, secret, encrypt=encrypt)
        except BaseException as exc:  # cannot bind: reported to the constructor
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if service.poll(tick_s):
                    while True:
                        request = service.receive()
                        if request is not None:
                            self._handle_request(service, request)
                        if not service.poll(0):
                            break
                self._after_tick(service)
        except BaseException as exc:  # a bug of ours: recorded, the public methods report it
            self._failure = exc
            self._on_failure()
        finally:
            service.close()
