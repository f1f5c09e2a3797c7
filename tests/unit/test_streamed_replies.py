"""Large replies over the payload stream (wire/service_streams.py, wire/channel_stream.py): on by
default (TENSORFLEET_PAYLOAD_STREAM=0 turns it off), a large reply's payload takes the client's
stream and arrives whole; small replies, either end off, a channel of small messages, or a
stream that cannot be opened keep every payload on ZeroMQ; a late reply's payload is read past; a stream that fails mid-payload fails
that request at once, and the next hello opens a new stream."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator

import pytest

from tensorfleet.errors import ConfigError, ConnectionLost
from tensorfleet.launch.ports import free_port
from tensorfleet.wire import channel_stream
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.service_streams import STREAM_MIN_BYTES, wanted

from .echo_service import SECRET, TIMEOUT_S, EchoService

LARGE = STREAM_MIN_BYTES + 12345


@pytest.fixture
def streaming(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[EchoService, Channel]]:
    monkeypatch.setenv("TENSORFLEET_PAYLOAD_STREAM", "1")
    service = EchoService(payload_stream=True)
    channel = Channel(service.address, SECRET, "ps:0", shared_memory=False)
    try:
        yield service, channel
    finally:
        channel.close()
        service.close()


def test_a_large_reply_takes_the_stream_and_a_small_one_zeromq(
    streaming: tuple[EchoService, Channel],
) -> None:
    service, channel = streaming
    channel.call("hello", {}, timeout_s=TIMEOUT_S)
    assert channel.stream.open
    large, small = os.urandom(LARGE), os.urandom(1000)
    reply = channel.call("echo", {}, [large, small], timeout_s=TIMEOUT_S)
    assert [bytes(b) for b in reply.buffers] == [large, small]
    assert service.socket.streams.sent == 1 and channel.stream.payloads == 1
    assert not any(b.readonly for b in reply.buffers)  # fresh memory: tensors may adopt it
    reply = channel.call("echo", {}, [small], timeout_s=TIMEOUT_S)  # below the threshold
    assert bytes(reply.buffers[0]) == small and service.socket.streams.sent == 1


def test_on_by_default_and_zero_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORFLEET_PAYLOAD_STREAM", raising=False)
    for setting, on in ((None, True), ("0", False)):
        if setting is not None:
            monkeypatch.setenv("TENSORFLEET_PAYLOAD_STREAM", setting)
        service = EchoService(payload_stream=None)  # the environment decides
        channel = Channel(service.address, SECRET, "ps:0", shared_memory=False)
        try:
            assert (service.socket.streams is not None) is on
            channel.call("hello", {}, timeout_s=TIMEOUT_S)
            large = os.urandom(LARGE)
            reply = channel.call("echo", {}, [large], timeout_s=TIMEOUT_S)
            assert bytes(reply.buffers[0]) == large
            assert channel.stream.open is on and channel.stream.payloads == int(on), setting
        finally:
            channel.close()
            service.close()


def test_the_setting_reads_on_and_off_and_refuses_anything_else() -> None:
    variable = "TENSORFLEET_PAYLOAD_STREAM"
    assert wanted({}) and wanted({variable: ""}) and wanted({variable: "1"})
    assert not wanted({variable: "0"}) and not wanted({variable: "off"})
    with pytest.raises(ConfigError, match="TENSORFLEET_PAYLOAD_STREAM='maybe'"):
        wanted({variable: "maybe"})


def test_a_channel_of_small_messages_opens_no_stream(
    streaming: tuple[EchoService, Channel],
) -> None:
    service, _ = streaming
    heartbeat = Channel(service.address, SECRET, "ps:0", shared_memory=False, payload_stream=False)
    try:
        heartbeat.call("hello", {}, timeout_s=TIMEOUT_S)
        assert not heartbeat.stream.open and not heartbeat.stream.enabled
    finally:
        heartbeat.close()


def test_a_client_without_streams_gets_its_payloads_on_zeromq(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = EchoService(payload_stream=True)
    monkeypatch.setenv("TENSORFLEET_PAYLOAD_STREAM", "0")
    channel = Channel(service.address, SECRET, "ps:0", shared_memory=False)
    try:
        channel.call("hello", {}, timeout_s=TIMEOUT_S)
        large = os.urandom(LARGE)
        assert bytes(channel.call("echo", {}, [large], timeout_s=TIMEOUT_S).buffers[0]) == large
        assert service.socket.streams.sent == 0 and not channel.stream.open
    finally:
        channel.close()
        service.close()


def test_a_stream_that_cannot_be_opened_is_said_once_and_payloads_stay_on_zeromq(
    streaming: tuple[EchoService, Channel], caplog: pytest.LogCaptureFixture
) -> None:
    service, channel = streaming
    service.socket.streams.port = free_port()  # named in the hello; nothing listens there
    with caplog.at_level(logging.WARNING, logger="tensorfleet.wire.channel_stream"):
        channel.call("hello", {}, timeout_s=TIMEOUT_S)
    assert not channel.stream.open and channel.stream.refused is not None
    assert [r.getMessage() for r in caplog.records if "payload stream" in r.getMessage()]
    large = os.urandom(LARGE)
    assert bytes(channel.call("echo", {}, [large], timeout_s=TIMEOUT_S).buffers[0]) == large
    assert service.socket.streams.sent == 0


def test_a_stream_port_that_never_answers_is_not_tried_again_by_that_channel(
    streaming: tuple[EchoService, Channel],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service, channel = streaming
    silent = socket.create_server(("127.0.0.1", 0))  # connects, never answers an opening
    try:
        service.socket.streams.port = silent.getsockname()[1]
        monkeypatch.setattr(channel_stream, "OPEN_TIMEOUT_S", 0.5)
        with caplog.at_level(logging.WARNING, logger="tensorfleet.wire.channel_stream"):
            channel.call("hello", {}, timeout_s=TIMEOUT_S)
            tries = [
                r.getMessage() for r in caplog.records if "does not try again" in r.getMessage()
            ]
            assert len(tries) == 1 and not channel.stream.open, tries
            opened = []
            monkeypatch.setattr(
                channel_stream, "open_stream", lambda *args: opened.append(args)
            )  # counts any further try
            channel.call("hello", {}, timeout_s=TIMEOUT_S)
            assert opened == []  # the second hello does not wait for the port again
        assert not channel.stream.enabled and channel.stream.refused is not None
        large = os.urandom(LARGE)
        assert bytes(channel.call("echo", {}, [large], timeout_s=TIMEOUT_S).buffers[0]) == large
        assert service.socket.streams.sent == 0
    finally:
        silent.close()


def test_the_payload_of_a_reply_nobody_waits_for_is_read_past(
    streaming: tuple[EchoService, Channel],
) -> None:
    service, channel = streaming
    channel.call("hello", {}, timeout_s=TIMEOUT_S)
    channel.send("echo", {}, [os.urandom(LARGE)], timeout_s=TIMEOUT_S)
    channel.forget_pending()  # given up: its reply, header and payload, arrives unwanted
    wanted = os.urandom(LARGE)
    reply = channel.call("echo", {}, [wanted], timeout_s=TIMEOUT_S)
    assert bytes(reply.buffers[0]) == wanted
    assert channel.dropped["unexpected"] == 1 and channel.stream.payloads == 2


def test_a_stream_cut_mid_payload_fails_that_request_and_the_next_hello_reopens_it(
    streaming: tuple[EchoService, Channel],
) -> None:
    service, channel = streaming
    channel.call("hello", {}, timeout_s=TIMEOUT_S)
    assert channel.stream.open  # and the service holds its sender: it said OPENED after that
    (stream,) = service.socket.streams._streams.values()
    stream.sender._conn.shutdown(1)  # the service's replies stop there (SHUT_WR)
    with pytest.raises(ConnectionLost, match="payload stream"):
        channel.call("echo", {}, [os.urandom(LARGE)], timeout_s=TIMEOUT_S)
    assert not channel.stream.open
    channel.call("hello", {}, timeout_s=TIMEOUT_S)  # what a client's recovery does
    assert channel.stream.open
    large = os.urandom(LARGE)
    assert bytes(channel.call("echo", {}, [large], timeout_s=TIMEOUT_S).buffers[0]) == large


class EndingService(EchoService):
    """Answers one request, then ends at once, as a preempted ps does after its reply to the
    chief's ``save``: the reply's payload is still leaving on the stream."""

    def _serve(self) -> None:
        try:
            while not self.stop.is_set():
                if self.socket.poll(0.05) and (request := self.socket.receive()) is not None:
                    self.socket.reply(request, {"op": request.op}, list(request.buffers))
                    if request.op == "last":
                        self.socket.close(linger_s=TIMEOUT_S)
                        return
        except BaseException as exc:  # surfaced by close()
            self.failure = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT_S)
        assert self.failure is None, self.failure


def test_a_service_that_ends_right_after_its_reply_lets_the_payload_leave_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TENSORFLEET_PAYLOAD_STREAM", "1")
    service = EndingService(payload_stream=True)
    channel = Channel(service.address, SECRET, "ps:0", shared_memory=False)
    try:
        channel.call("hello", {}, timeout_s=TIMEOUT_S)
        large = os.urandom(64 * 1024 * 1024)  # far more than the sockets' buffers hold
        reply = channel.call("last", {}, [large], timeout_s=TIMEOUT_S)
        assert bytes(reply.buffers[0]) == large and channel.stream.payloads == 1
    finally:
        channel.close()
        service.close()
