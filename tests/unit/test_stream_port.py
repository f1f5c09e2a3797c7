"""The payload stream's port (TENSORFLEET_PAYLOAD_STREAM_PORT, wire/service_streams.py): a set
port is the one the service listens on and names to its clients, who carry large payloads
there; a port already taken leaves the service on ZeroMQ with one warning naming the port and
the variable; anything but a port number is refused with the value and the fix."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from tensorfleet.errors import ConfigError
from tensorfleet.launch.ports import free_port
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.service_streams import STREAM_MIN_BYTES, listen_port

from .echo_service import SECRET, TIMEOUT_S, EchoService

VARIABLE = "TENSORFLEET_PAYLOAD_STREAM_PORT"


def echo_large(service: EchoService) -> Channel:
    """A channel that said hello to ``service`` and had a large payload echoed."""
    channel = Channel(service.address, SECRET, "ps:0", shared_memory=False)
    channel.call("hello", {}, timeout_s=TIMEOUT_S)
    large = os.urandom(STREAM_MIN_BYTES + 777)
    reply = channel.call("echo", {}, [large], timeout_s=TIMEOUT_S)
    assert bytes(reply.buffers[0]) == large
    return channel


def test_a_set_port_is_where_the_service_listens_and_the_payloads_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    monkeypatch.setenv(VARIABLE, str(port))
    service = EchoService(payload_stream=True)
    channel = None
    try:
        assert service.socket.streams is not None and service.socket.streams.port == port
        channel = echo_large(service)
        assert channel.stream.open and channel.stream.payloads == 1
        assert service.socket.streams.sent == 1
    finally:
        if channel is not None:
            channel.close()
        service.close()


def test_a_taken_port_is_said_once_and_the_payloads_stay_on_zeromq(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    monkeypatch.setenv(VARIABLE, str(port))
    channel = None
    try:
        with caplog.at_level(logging.WARNING):
            service = EchoService(payload_stream=True)
        try:
            assert service.socket.streams is None
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1, warnings
            assert f"port {port} ({VARIABLE})" in warnings[0]
            assert "every payload stays on ZeroMQ" in warnings[0]
            assert f"free port {port}, or set {VARIABLE} to another port" in warnings[0]
            channel = echo_large(service)
            assert not channel.stream.open and channel.stream.payloads == 0
        finally:
            if channel is not None:
                channel.close()
            service.close()
    finally:
        taken.close()


def test_the_setting_reads_a_port_or_nothing_and_refuses_anything_else() -> None:
    assert listen_port({}) == 0 and listen_port({VARIABLE: ""}) == 0
    assert listen_port({VARIABLE: "0"}) == 0 and listen_port({VARIABLE: " 2223 "}) == 2223
    for value in ("stream", "70000", "-1", "22.5"):
        with pytest.raises(ConfigError, match=rf"{VARIABLE}='{value}' is not a TCP port"):
            listen_port({VARIABLE: value})
