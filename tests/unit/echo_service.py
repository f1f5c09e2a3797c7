"""A ServiceSocket in a thread that answers every request with its own buffers and records
the ops in the order it served them: the peer of the payload stream's tests."""

from __future__ import annotations

import threading

from tensorfleet.launch.ports import free_port
from tensorfleet.wire.service_socket import ServiceSocket

SECRET = b"k" * 32
TIMEOUT_S = 10.0


class EchoService:
    """``payload_stream`` as ServiceSocket takes it (None: the environment decides)."""

    def __init__(self, payload_stream: bool | None) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.socket = ServiceSocket(
            self.address, SECRET, shared_memory=False, payload_stream=payload_stream
        )
        self.served: list[str] = []
        self.stop = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while not self.stop.is_set():
                if self.socket.poll(0.05) and (request := self.socket.receive()) is not None:
                    self.served.append(request.op)
                    self.socket.reply(request, {"op": request.op}, list(request.buffers))
        except BaseException as exc:  # surfaced by close()
            self.failure = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT_S)
        self.socket.close()
        assert self.failure is None, self.failure
