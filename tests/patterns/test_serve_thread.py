"""The patterns' serve-thread base: a constructor that returns only once the socket is bound
(or raises why not), requests dispatched to the subclass, a failure in the serving thread
recorded and reported, and the socket closed whatever ended the thread."""

from __future__ import annotations

import threading

import pytest

from tensorfleet.errors import ListenError
from tensorfleet.patterns.broadcast import free_address
from tensorfleet.patterns.serve_thread import ServeThread
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.service_socket import Request, ServiceSocket

pytestmark = pytest.mark.timeout(60)

SECRET = b"serve-thread-test-secret-0123456"


class Echo(ServeThread):
    """Answers ``echo`` with its body; its tick raises once ``fail`` is set."""

    def __init__(self, address: str) -> None:
        self.ticks = 0
        self.fail = threading.Event()
        self.failed = threading.Event()
        self._start_serving(
            address, SECRET, encrypt=False, name="echo", what="the echo server", tick_s=0.005
        )

    def _handle_request(self, service: ServiceSocket, request: Request) -> None:
        service.reply(request, {"echo": request.body.get("text")})

    def _after_tick(self, service: ServiceSocket) -> None:
        self.ticks += 1
        if self.fail.is_set():
            raise RuntimeError("a bug in the tick")

    def _on_failure(self) -> None:
        self.failed.set()


def test_requests_reach_the_subclass_and_close_frees_the_address() -> None:
    address = free_address()
    server = Echo(address)
    channel = Channel(address, SECRET, "echo")
    try:
        assert channel.call("hello", {"text": "hello"}, timeout_s=10).body == {"echo": "hello"}
        assert channel.call("echo", {"text": "hi"}, timeout_s=10).body == {"echo": "hi"}
    finally:
        channel.close()
        server.close()
    assert not server._thread.is_alive()
    Echo(address).close()  # the socket was closed: the address can be bound again


def test_a_taken_address_is_reported_by_the_constructor() -> None:
    address = free_address()
    first = Echo(address)
    try:
        with pytest.raises(ListenError, match=address):
            Echo(address)
    finally:
        first.close()


def test_a_failure_in_the_serving_thread_is_recorded_and_the_socket_closed() -> None:
    address = free_address()
    server = Echo(address)
    try:
        server.fail.set()
        assert server.failed.wait(10), "the serving thread's failure was not reported"
        assert isinstance(server._failure, RuntimeError)
        server._thread.join(10)
        assert not server._thread.is_alive()
    finally:
        server.close()
    Echo(address).close()
