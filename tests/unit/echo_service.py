"""A ServiceSocket in a thread that answers every request with its own buffers and records
the ops in the order it served them: the peer of the wire's tests (the payload stream's,
encryption's, shared memory's)."""

from __future__ import annotations

import threading
from typing import Any

from tensorfleet.launch.ports import free_port
from tensorfleet.wire.service_request import Request
from tensorfleet.wire.service_socket import ServiceSocket

SECRET = b"k" * 32
TIMEOUT_S = 10.0


class EchoService:
    """A service on ``port`` (None: a free one) under ``secret``, with ``socket_options`` as
    :class:`ServiceSocket` takes them (``shared_memory`` off unless given); ``served`` lists
    the ops of the requests answered. Subclasses record more per request (:meth:`record`)."""

    def __init__(
        self, port: int | None = None, secret: bytes = SECRET, **socket_options: Any
    ) -> None:
        self.address = f"127.0.0.1:{port or free_port()}"
        options = {"shared_memory": False, **socket_options}
        self.socket = ServiceSocket(self.address, secret, **options)
        self.served: list[str] = []
        self.stop = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def record(self, request: Request) -> None:
        """Called with each request before its answer."""
        self.served.append(request.op)

    def _serve(self) -> None:
        try:
            while not self.stop.is_set():
                if self.socket.poll(0.05) and (request := self.socket.receive()) is not None:
                    self.record(request)
                    self.socket.reply(request, {"op": request.op}, list(request.buffers))
        except BaseException as exc:  # surfaced by close()
            self.failure = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT_S)
        self.socket.close()
        assert self.failure is None, self.failure
