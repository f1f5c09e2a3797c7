"""Large requests over the payload stream (wire/channel_stream.py, wire/payload_collector.py,
wire/held_requests.py): with TENSORFLEET_PAYLOAD_STREAM=1 a large request's payload takes the
client's stream and arrives whole; a client's requests are served in the order it sent them
while its payload is still arriving, and other clients are served meanwhile; a payload that is
altered, cut short or never comes ends that request with PayloadStreamLost (not a hang), no
later reply takes the stream that failed, and the next hello opens a new stream."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Iterator

import pytest

from tensorfleet.errors import PayloadStreamLost, ServiceRestarted
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.held_requests import HeldMessage, HeldRequests
from tensorfleet.wire.payload_collector import PendingPayload
from tensorfleet.wire.service_streams import STREAM_MIN_BYTES

from .echo_service import SECRET, TIMEOUT_S, EchoService

LARGE = STREAM_MIN_BYTES + 4321


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


@pytest.fixture
def streaming(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[EchoService, Channel]]:
    monkeypatch.setenv("TENSORFLEET_PAYLOAD_STREAM", "1")
    service = EchoService(payload_stream=True)
    channel = Channel(service.address, SECRET, "ps:0", shared_memory=False)
    try:
        channel.call("hello", {}, timeout_s=TIMEOUT_S)
        assert channel.stream.open
        yield service, channel
    finally:
        channel.close()
        service.close()


class HeldBack:
    """Stands in for a stream's sender: keeps the payloads until :meth:`release`."""

    def __init__(self, channel: Channel) -> None:
        self.sender = channel.stream._sender
        self.calls: list[tuple] = []
        self.sender_send, self.sender.send = self.sender.send, self._keep  # type: ignore[method-assign]

    def _keep(self, *args) -> None:
        self.calls.append(args)

    def release(self) -> None:
        self.sender.send = self.sender_send  # type: ignore[method-assign]
        for args in self.calls:
            self.sender_send(*args)


def test_a_large_request_takes_the_stream_and_a_small_one_zeromq(
    streaming: tuple[EchoService, Channel],
) -> None:
    service, channel = streaming
    large, small = os.urandom(LARGE), os.urandom(1000)
    reply = channel.call("echo", {}, [large, small], timeout_s=TIMEOUT_S)
    assert [bytes(b) for b in reply.buffers] == [large, small]
    assert channel.stream.sent == 1 and service.socket.streams.received == 1
    channel.call("echo", {}, [small], timeout_s=TIMEOUT_S)
    assert channel.stream.sent == 1 and service.socket.streams.received == 1


def test_a_clients_requests_wait_in_order_behind_its_payload_and_others_go_on(
    streaming: tuple[EchoService, Channel],
) -> None:
    service, channel = streaming
    other = Channel(service.address, SECRET, "ps:0", shared_memory=False)
    try:
        held = HeldBack(channel)
        large = os.urandom(LARGE)
        first = channel.send("push", {}, [large], timeout_s=TIMEOUT_S)
        second = channel.send("pull", {}, [], timeout_s=TIMEOUT_S)
        wait_until(lambda: len(service.socket._held) == 2, "both requests are held")
        other.call("hello", {}, timeout_s=TIMEOUT_S)  # another client is served meanwhile
        assert service.served == ["hello", "hello"]
        held.release()
        assert bytes(channel.wait(first, TIMEOUT_S).buffers[0]) == large
        channel.wait(second, TIMEOUT_S)
        assert service.served == ["hello", "hello", "push", "pull"]
        assert len(service.socket._held) == 0
    finally:
        other.close()


def test_a_payload_that_never_comes_fails_its_request_at_its_deadline(
    streaming: tuple[EchoService, Channel],
) -> None:
    service, channel = streaming
    HeldBack(channel)  # never released
    request = channel.send("push", {}, [os.urandom(LARGE)], timeout_s=1.0)
    with pytest.raises(PayloadStreamLost, match="did not arrive"):
        channel.wait(request, TIMEOUT_S)
    assert service.socket.rejected["stream"] == 1 and "push" not in service.served


class WrongTags:
    """A signer whose chunk tags are wrong: the payload is altered on the way."""

    def __init__(self, signer) -> None:
        self.signer = signer

    def chunk_tag(self, counter: int, index: int, chunk) -> bytes:
        return bytes(16)


def test_an_altered_payload_is_refused_and_the_next_hello_opens_a_new_stream(
    streaming: tuple[EchoService, Channel],
) -> None:
    service, channel = streaming
    channel.stream._sender._signer = WrongTags(channel.stream._sender._signer)
    with pytest.raises(PayloadStreamLost, match="authentication failed") as refused:
        channel.call("push", {}, [os.urandom(LARGE)], timeout_s=TIMEOUT_S)
    assert isinstance(refused.value, ServiceRestarted)  # the client's recovery says hello
    assert "push" not in service.served
    # The service closed that stream. A client that still takes it for open sends the next
    # payload there and is refused at once; one whose sender already saw the close (it was
    # still writing the altered payload when the service shut the connection) sends it over
    # ZeroMQ, and it is served, its reply over ZeroMQ too (next test). No reply is lost.
    large = os.urandom(LARGE)
    if channel.stream.open:
        with pytest.raises(PayloadStreamLost):
            channel.call("push", {}, [large], timeout_s=TIMEOUT_S)
    else:
        assert bytes(channel.call("push", {}, [large], timeout_s=TIMEOUT_S).buffers[0]) == large
    channel.call("hello", {}, timeout_s=TIMEOUT_S)
    assert channel.stream.open
    large = os.urandom(LARGE)
    assert bytes(channel.call("push", {}, [large], timeout_s=TIMEOUT_S).buffers[0]) == large


def test_no_reply_takes_a_stream_whose_payload_failed(
    streaming: tuple[EchoService, Channel],
) -> None:
    """The order the previous test can meet by chance, made certain: the client's sender saw
    the close before its next push, which goes over ZeroMQ and is served; the service, whose
    sender to that client has not written since, sends the large reply over ZeroMQ too."""
    service, channel = streaming
    channel.stream._sender._signer = WrongTags(channel.stream._sender._signer)
    with pytest.raises(PayloadStreamLost, match="authentication failed"):
        channel.call("push", {}, [os.urandom(LARGE)], timeout_s=TIMEOUT_S)
    channel.stream._sender.failure = "seen closed"  # as its next write would find it
    assert not channel.stream.open
    sent = service.socket.streams.sent
    large = os.urandom(LARGE)
    assert bytes(channel.call("push", {}, [large], timeout_s=TIMEOUT_S).buffers[0]) == large
    assert service.socket.streams.sent == sent and service.served.count("push") == 1


def test_a_stream_cut_mid_payload_fails_that_request_not_the_service(
    streaming: tuple[EchoService, Channel],
) -> None:
    service, channel = streaming
    sender = channel.stream._sender
    original = sender._send_one

    def cut_after_first_chunk(payload) -> None:
        views = [memoryview(b).cast("B") for b in payload.buffers]
        first = [views[0][: 1 << 20]]
        original(type(payload)(payload.counter, first, payload.on_done))
        sender._conn.shutdown(2)  # the client dies mid-payload

    sender._send_one = cut_after_first_chunk
    with pytest.raises(PayloadStreamLost, match="ended after"):
        channel.call("push", {}, [os.urandom(LARGE)], timeout_s=TIMEOUT_S)
    channel.call("hello", {}, timeout_s=TIMEOUT_S)
    large = os.urandom(LARGE)
    assert bytes(channel.call("push", {}, [large], timeout_s=TIMEOUT_S).buffers[0]) == large


def test_held_requests_leave_in_order_only_when_their_payload_is_done() -> None:
    held = HeldRequests()
    try:
        payload = PendingPayload(7, [10], deadline=0.0)
        assert held.hold(b"s" * 16, HeldMessage(b"peer", [b"a"], payload))
        assert held.hold(b"s" * 16, HeldMessage(b"peer", [b"b"], None))
        assert held.hold(b"t" * 16, HeldMessage(b"other", [b"c"], None))
        session, first = held.next_ready()
        assert first.frames == [b"c"]  # another session is not held back
        assert not held.ready() and held.next_ready() is None
        payload.finish([memoryview(bytes(10))], None)
        held.wake()
        assert held.ready()
        assert held.next_ready()[1].frames == [b"a"]
        assert held.next_ready()[1].frames == [b"b"]
        assert len(held) == 0 and not held.holds(b"s" * 16)
    finally:
        held.close()
    held.wake()  # after close: nothing is written anywhere


def test_a_wake_is_drained_once_and_leaves_the_pipe_quiet() -> None:
    """The service polls the wake pipe: after a wake it is readable until the next drain,
    which empties it; a drain with no wake since leaves it (and the poll) quiet."""
    held = HeldRequests()

    def readable() -> bool:
        return bool(select.select([held.fileno()], [], [], 0)[0])

    try:
        assert not readable()
        held.next_ready()  # nothing written: nothing to read
        assert not readable()
        held.wake()
        held.wake()
        assert readable()
        held.next_ready()
        assert not readable()  # both wakes drained by one drain
        held.wake()
        assert readable()
        held.next_ready()
        assert not readable()
    finally:
        held.close()
