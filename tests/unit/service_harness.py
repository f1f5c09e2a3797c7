"""A real :class:`ParameterService` on a :class:`ServiceSocket` bound to a free loopback port,
served in a background thread, for the unit tests that talk to it over the wire
(``test_parameter_service.py``, ``test_sync_service.py``, ``test_service_checkpoints.py``).

:func:`serve_in_thread` starts one from a :class:`ServiceConfig` and the cluster secret. Each
test module has a thin fixture with its own defaults and secret: it keeps the handles it started
and the channels it opened to them, and hands both to :func:`stop_services` at teardown, which
closes the channels, stops the services and fails the test if one of them crashed or did not
stop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from tensorfleet.launch.ports import free_port
from tensorfleet.ps.service import ParameterService, ServiceConfig, ServiceOutcome
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.service_socket import ServiceSocket
from tensorfleet.wire.tensors import as_buffer, from_buffer

TIMEOUT_S = 5.0
"""How long a service may take to stop (it takes milliseconds once woken)."""


@dataclass
class RunningService:
    """A service serving in a background thread until ``stop`` is set."""

    address: str
    """``host:port`` its socket is bound to."""
    service: ParameterService
    stop: threading.Event
    thread: threading.Thread
    result: dict[str, Any]
    """``outcome`` (what serve() returned) or ``error`` (what it raised)."""

    def outcome(self, timeout_s: float = TIMEOUT_S) -> ServiceOutcome:
        """Wait for serve() to return by itself; its outcome (or what it raised, raised)."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"serve() still running after {timeout_s} s"
        if "error" in self.result:
            raise self.result["error"]
        return self.result["outcome"]

    @property
    def rejected(self) -> dict[str, int]:
        """The socket's counts of rejected frames, by reason."""
        return dict(self.service.socket.rejected)


def serve_in_thread(
    config: ServiceConfig, secret: bytes, address: str | None = None
) -> RunningService:
    """Bind a service for ``config`` to ``address`` (default: a free loopback port), signing
    with ``secret``, and serve it in a (daemon) thread; the same address again after
    :func:`stop_services` is a restarted ps. A crash of serve() is kept in ``result["error"]``
    for :func:`stop_services` to report."""
    address = address or f"127.0.0.1:{free_port()}"
    service = ParameterService(ServiceSocket(address, secret, config.limits), config)
    stop = threading.Event()
    result: dict[str, Any] = {}

    def serve() -> None:
        try:
            result["outcome"] = service.serve(stop)
        except BaseException as exc:  # reported at teardown: a crash fails the test
            result["error"] = exc

    thread = threading.Thread(target=serve, name=f"ps@{address}", daemon=True)
    handle = RunningService(address, service, stop, thread, result)
    thread.start()
    return handle


def stop_services(
    services: Iterable[RunningService],
    channels: Iterable[Channel] = (),
    timeout_s: float = TIMEOUT_S,
) -> None:
    """Close ``channels`` (the test's connections to the services), then stop every service,
    close the sockets of those that stopped, and fail (AssertionError) if any crashed or is
    still running after ``timeout_s``.

    A service blocked in poll() only looks at its stop event at the end of its poll interval;
    one (rejected) frame from a raw DEALER socket wakes it now, so that teardowns stay fast."""
    for channel in channels:
        channel.close()
    problems = []
    context = zmq.Context(io_threads=1)
    try:
        for handle in services:
            handle.stop.set()
            if handle.thread.is_alive():
                with context.socket(zmq.DEALER) as waker:
                    waker.setsockopt(zmq.LINGER, 1000)
                    waker.connect(f"tcp://{handle.address}")
                    waker.send(b"wake up")
            handle.thread.join(timeout_s)
            if handle.thread.is_alive():
                problems.append(f"{handle.address}: did not stop")
            else:
                handle.service.socket.close()
            if "error" in handle.result:
                problems.append(f"{handle.address}: {handle.result['error']!r}")
    finally:
        context.term()
    assert not problems, f"service thread crashed or hung: {problems}"


@contextmanager
def worker_shards(count: int, secret: bytes) -> Iterator[list[RunningService]]:
    """``count`` shards serving one worker (``worker:0``), stopped (and checked) at the end:
    the fixture of the tests that talk to tables on several real shards."""
    services = [
        serve_in_thread(ServiceConfig(i, ("worker:0",), idle_timeout_s=60.0), secret)
        for i in range(count)
    ]
    try:
        yield services
    finally:
        stop_services(services)


def bits(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor``: compared to prove two tensors bit for bit equal."""
    return bytes(as_buffer(tensor.contiguous()))


def assert_values(buffers: list, expected: list[torch.Tensor]) -> None:
    """Each received value buffer holds exactly the bits of the expected tensor."""
    assert len(buffers) == len(expected)
    for buffer, tensor in zip(buffers, expected, strict=True):
        received = from_buffer(buffer, tensor.dtype)
        assert bits(received) == bits(tensor), f"{received} != {tensor}"
