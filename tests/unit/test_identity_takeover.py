"""Identity takeover through a real parameter service: a restarted task whose launcher says its
predecessor is dead (``TENSORFLEET_PREDECESSOR_DEAD=1`` -> ``"takeover": true`` in the hello)
is let in at once, and the old process's later requests are refused with
:class:`IdentityInUse`; without the flag the existing refusal still happens.

The liveness timeout is an hour here, so nothing in these tests can be explained by the
predecessor falling silent.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tensorfleet import environment
from tensorfleet.errors import IdentityInUse
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.channel import Channel
from tensorfleet.worker.client import ClientTimeouts, ParameterClient

from .service_harness import RunningService, serve_in_thread, stop_services

SECRET = b"identity-takeover-unit-test-secret-01"
WORKERS = ("worker:0", "worker:1")
TIMEOUT_S = 5.0
"""Upper bound of every wait expected to succeed (they take milliseconds)."""
HOUR_S = 3600.0
HELLO = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": "worker:1"}


@pytest.fixture
def ps() -> Iterator[tuple[RunningService, list[Channel]]]:
    handle = serve_in_thread(
        ServiceConfig(shard_index=0, worker_tasks=WORKERS, liveness_timeout_s=HOUR_S), SECRET
    )
    channels: list[Channel] = []
    try:
        yield handle, channels
    finally:
        stop_services([handle], channels)


def _channel(ps: tuple[RunningService, list[Channel]]) -> Channel:
    channel = Channel(ps[0].address, SECRET, "ps:0")
    ps[1].append(channel)
    return channel


def _heartbeat(channel: Channel) -> dict:
    return channel.call("heartbeat", {"task": "worker:1"}, timeout_s=TIMEOUT_S).body


def test_takeover_is_admitted_at_once_and_the_old_process_is_refused(
    ps: tuple[RunningService, list[Channel]],
) -> None:
    old, old_heartbeat, new = _channel(ps), _channel(ps), _channel(ps)
    old.call("hello", {**HELLO, "instance": "old-process"}, timeout_s=TIMEOUT_S)
    old_heartbeat.call("hello", {**HELLO, "instance": "old-process"}, timeout_s=TIMEOUT_S)
    _heartbeat(old)
    reply = new.call(
        "hello", {**HELLO, "instance": "new-process", "takeover": True}, timeout_s=TIMEOUT_S
    )
    assert reply.body["shard"] == 0
    _heartbeat(new)
    for channel in (old, old_heartbeat):  # every channel of the old process
        with pytest.raises(IdentityInUse) as excinfo:
            _heartbeat(channel)
        assert "worker:1's identity was taken over by another process (new-process; this is " in (
            str(excinfo.value)
        )
    with pytest.raises(IdentityInUse, match="worker:1 is already running in another process"):
        old.call("hello", {**HELLO, "instance": "old-process"}, timeout_s=TIMEOUT_S)
    stats = new.call("stats", {"task": "worker:1"}, timeout_s=TIMEOUT_S).body
    assert stats["refused"] == 3 and stats["lost_workers"] == []


@pytest.mark.parametrize("flag", [None, False, "true", 1])
def test_without_a_true_takeover_flag_the_refusal_still_happens(
    ps: tuple[RunningService, list[Channel]], flag: object
) -> None:
    old, new = _channel(ps), _channel(ps)
    old.call("hello", {**HELLO, "instance": "old-process"}, timeout_s=TIMEOUT_S)
    body = {**HELLO, "instance": "new-process"}
    if flag is not None:
        body["takeover"] = flag
    with pytest.raises(IdentityInUse, match="worker:1 is already running in another process"):
        new.call("hello", body, timeout_s=TIMEOUT_S)
    _heartbeat(old)  # the holder is still served


def test_a_takeover_hello_is_authenticated_like_any_message(
    ps: tuple[RunningService, list[Channel]],
) -> None:
    old = _channel(ps)
    old.call("hello", {**HELLO, "instance": "old-process"}, timeout_s=TIMEOUT_S)
    intruder = Channel(ps[0].address, b"not-the-cluster-secret-0000000000", "ps:0")
    ps[1].append(intruder)
    with pytest.raises(Exception, match="secret"):
        intruder.call(
            "hello", {**HELLO, "instance": "intruder", "takeover": True}, timeout_s=TIMEOUT_S
        )
    _heartbeat(old)  # the identity did not move
    assert ps[0].rejected.get("auth", 0) >= 1


def test_a_restarted_client_with_the_launchers_word_connects_at_once(
    ps: tuple[RunningService, list[Channel]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ParameterClient: the environment variable puts ``takeover`` in its hello."""
    timeouts = ClientTimeouts(connect_s=2.0)  # far below the liveness timeout
    address = [ps[0].address]
    clients = []
    try:
        old = ParameterClient(address, SECRET, "worker:1", timeouts)
        clients.append(old)
        assert old.takeover is False
        assert old.connect() == [False]
        second = ParameterClient(address, SECRET, "worker:1", timeouts)
        clients.append(second)
        with pytest.raises(IdentityInUse):  # no word from the launcher: refused
            second.connect()
        monkeypatch.setenv(environment.PREDECESSOR_DEAD_VAR, "1")
        new = ParameterClient(address, SECRET, "worker:1", timeouts)
        clients.append(new)
        assert new.takeover is True
        assert new.connect() == [False]
        assert new.stats()[0]["refused"] >= 1
        with pytest.raises(IdentityInUse, match="worker:1's identity was taken over"):
            old.stats()
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize(
    ("value", "dead"), [("1", True), ("true", True), (" YES ", True), ("0", False), ("", False)]
)
def test_predecessor_dead_reads_the_variable(value: str, dead: bool) -> None:
    assert environment.predecessor_dead({environment.PREDECESSOR_DEAD_VAR: value}) is dead
    assert environment.predecessor_dead({}) is False
