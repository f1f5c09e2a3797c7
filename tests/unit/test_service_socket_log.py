"""A service says in its log what it drops (``wire/service_socket.py``): junk from a raw
socket, a connection quarantined, a hello signed with the wrong secret; at most one line per
kind per interval, with the count so far, the peer's address and none of the peer's bytes.

The socket is driven from the test's thread (``poll`` then ``receive``), so every message is
handled before the assertions, without sleeps; the rate limit runs on a hand-moved clock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import zmq

from tensorfleet.launch.ports import free_port
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.auth import REQUEST_ROLE, MessageSigner
from tensorfleet.wire.service_socket import (
    QUARANTINE_AFTER_INVALID,
    RejectionLog,
    ServiceSocket,
    peer_address,
)

pytestmark = pytest.mark.timeout(30)
SECRET = b"service-socket-log-test-secret-0123"
WRONG_SECRET = b"not-the-cluster-secret-0123456789"
#: Junk a peer sends: a terminal escape and a marker that must never reach the log.
JUNK = b"\x1b[31mJUNK-FROM-THE-PEER\n"


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def service() -> Iterator[tuple[ServiceSocket, Clock, zmq.Context]]:
    """A real service socket on a free port (its rejection log on a hand-moved clock), and a
    context for raw peers; everything closed after the test."""
    sock = ServiceSocket(f"127.0.0.1:{free_port()}", SECRET)
    clock = Clock()
    sock.rejection_log = RejectionLog(sock.address, clock=clock)
    context = zmq.Context(io_threads=1)
    try:
        yield sock, clock, context
    finally:
        sock.close()
        context.destroy(linger=0)


def _peer(context: zmq.Context, sock: ServiceSocket) -> zmq.Socket:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{sock.address}")
    return dealer


def _deliver(sock: ServiceSocket, dealer: zmq.Socket, frames: list[bytes]) -> None:
    """Send ``frames`` from ``dealer`` and have the service receive them (it drops them)."""
    dealer.send_multipart(frames)
    assert sock.poll(10.0), "the message did not arrive"
    assert sock.receive() is None


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tensorfleet.security"]


def test_junk_is_logged_once_per_kind_with_address_and_count_and_no_peer_bytes(
    service: tuple[ServiceSocket, Clock, zmq.Context], caplog: pytest.LogCaptureFixture
) -> None:
    sock, clock, context = service
    caplog.set_level(logging.WARNING, logger="tensorfleet.security")
    first = _peer(context, sock)
    for _ in range(QUARANTINE_AFTER_INVALID + 3):  # the last 3 arrive quarantined
        _deliver(sock, first, [JUNK])
    assert sock.rejected == {"malformed": QUARANTINE_AFTER_INVALID, "quarantined": 3}
    malformed, quarantine = _lines(caplog)
    assert malformed == (
        f"tensorfleet service {sock.address}: dropped a message from 127.0.0.1: it is not a "
        "well-formed tensorfleet message (junk, a port scanner, or another program pointed at "
        "this port) (1 dropped as 'malformed' so far)"
    )
    assert quarantine.startswith(
        f"tensorfleet service {sock.address}: ignoring the connection from 127.0.0.1 for good "
        f"after {QUARANTINE_AFTER_INVALID} invalid messages"
    )
    assert "(1 connection(s) quarantined so far)" in quarantine
    assert "JUNK" not in caplog.text and "\x1b" not in caplog.text
    assert all(r.levelno == logging.WARNING for r in caplog.records)

    # Within the interval, a second connection's junk is counted, not logged ...
    second = _peer(context, sock)
    for _ in range(2):
        _deliver(sock, second, [JUNK])
    assert len(_lines(caplog)) == 2
    # ... and after it, the next line gives the count so far and how many went unlogged.
    clock.now += sock.rejection_log.interval_s
    _deliver(sock, second, [JUNK])
    unlogged = QUARANTINE_AFTER_INVALID - 1 + 2  # the first connection's and the second's
    assert _lines(caplog)[2].endswith(
        f"({QUARANTINE_AFTER_INVALID + 3} dropped as 'malformed' so far, {unlogged} not logged "
        "since the last such line: at most one per 60 s)"
    )


def test_a_hello_with_the_wrong_secret_is_logged(
    service: tuple[ServiceSocket, Clock, zmq.Context], caplog: pytest.LogCaptureFixture
) -> None:
    sock, _, context = service
    caplog.set_level(logging.WARNING, logger="tensorfleet.security")
    body = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": "worker:0"}
    header = {"op": "hello", "id": 1, "srv": None, "timeout_ms": 5000, "body": body}
    signer = MessageSigner(WRONG_SECRET, REQUEST_ROLE)
    frames = [bytes(f) for f in wire.encode(wire.KIND_REQUEST, header, [], signer)]
    _deliver(sock, _peer(context, sock), frames)
    assert sock.rejected == {"auth": 1}
    (line,) = _lines(caplog)
    assert line.startswith(
        f"tensorfleet service {sock.address}: dropped a message from 127.0.0.1: it failed "
        "authentication (the sender does not hold this cluster's secret"
    )
    assert "--secret-file" in line and line.endswith("(1 dropped as 'auth' so far)")
    assert "worker:0" not in line  # nothing the peer sent, not even its claimed task


def test_a_message_read_after_newer_ones_is_logged_as_replayed_not_as_a_wrong_secret(
    service: tuple[ServiceSocket, Clock, zmq.Context], caplog: pytest.LogCaptureFixture
) -> None:
    """A ps stopped while a worker's push was in flight reads, on its SIGCONT, that push from
    the worker's old connection after the newer requests of its new one: its counter is
    below the last accepted. It was logged as a wrong secret ("give every task the same
    secret"), found in a new user's trial; it is a replay now, with what it means."""
    sock, _, context = service
    caplog.set_level(logging.WARNING, logger="tensorfleet.security")
    body = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": "worker:0"}
    signer = MessageSigner(SECRET, REQUEST_ROLE)
    old, new = (
        [bytes(f) for f in wire.encode(wire.KIND_REQUEST, header, [], signer)]
        for header in (
            {"op": "hello", "id": i, "srv": None, "timeout_ms": 5000, "body": body} for i in (1, 2)
        )
    )
    dealer = _peer(context, sock)
    dealer.send_multipart(new)  # the newer message is read first
    assert sock.poll(10.0) and sock.receive() is not None
    _deliver(sock, dealer, old)
    assert sock.rejected == {"replayed": 1}
    (line,) = _lines(caplog)
    assert line.startswith(
        f"tensorfleet service {sock.address}: dropped a message from 127.0.0.1: its counter is "
        "not above the last one accepted from its session: a request its client gave up on"
    )
    assert "secret" not in line and line.endswith("(1 dropped as 'replayed' so far)")


def test_a_peer_address_with_odd_characters_is_not_logged() -> None:
    class Frame:
        def __init__(self, address: object) -> None:
            self.address = address

        def get(self, name: str) -> object:
            assert name == "Peer-Address"
            return self.address

    assert peer_address(Frame("10.0.0.7")) == "10.0.0.7"  # type: ignore[arg-type]
    assert peer_address(Frame("fe80::1%eth0")) == "fe80::1%eth0"  # type: ignore[arg-type]
    for odd in ("10.0.0.7\nFAKE LINE", "\x1b[31m", "", "x" * 65, None):
        assert peer_address(Frame(odd)) == "an unknown address"  # type: ignore[arg-type]
    assert peer_address(None) == "an unknown address"
