"""Typed remote errors: a refusal crosses the wire as a code, and the client raises the class
registered for it (so callers decide by type, never by the words of a message).

Two kinds of test: each code sent by a real :class:`ServiceSocket` arrives through a real
:class:`Channel` as its class (an unknown code as plain :class:`RemoteError`), with the peer,
the operation and the server's text in the message; and a real parameter service sends the
right code for each kind of refusal it makes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tensorfleet.errors import (
    EncryptionMismatch,
    IdentityInUse,
    NotInitialized,
    RemoteDeadlineExceeded,
    RemoteError,
    RemoteProtocolError,
    RequestRefused,
    ServiceRestarted,
    TensorfleetError,
    WorkerLost,
    remote_error_class,
)
from tensorfleet.launch.ports import free_port
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import SGD
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.service_socket import ServiceSocket
from tensorfleet.wire.tensors import as_buffer

from .service_harness import RunningService, serve_in_thread, stop_services

SECRET = b"remote-errors-unit-test-secret-000001"
TIMEOUT_S = 5.0
"""Upper bound of every wait (they take milliseconds)."""
CREATE_TIMEOUT_S = 60.0
"""The first ``create`` of a process builds the first torch optimizer, which imports much of
torch (seconds on a loaded machine)."""

CODED = [
    ServiceRestarted,
    IdentityInUse,
    NotInitialized,
    WorkerLost,
    RequestRefused,
    RemoteProtocolError,
    RemoteDeadlineExceeded,
    EncryptionMismatch,
]


@pytest.fixture
def pair() -> Iterator[tuple[ServiceSocket, Channel]]:
    """A real service socket and a channel to it that has said hello."""
    address = f"127.0.0.1:{free_port()}"
    service = ServiceSocket(address, SECRET)
    channel = Channel(address, SECRET, "ps:0")
    try:
        request_id = channel.send("hello", {}, timeout_s=TIMEOUT_S)
        request = _receive(service)
        service.reply(request, {})
        channel.wait(request_id, TIMEOUT_S)
        yield service, channel
    finally:
        channel.close()
        service.close()


def _receive(service: ServiceSocket):
    assert service.poll(TIMEOUT_S), "the request did not arrive"
    request = service.receive()
    assert request is not None, dict(service.rejected)
    return request


def _refused_with(pair: tuple[ServiceSocket, Channel], code: object) -> RemoteError:
    service, channel = pair
    request_id = channel.send("push", {"task": "worker:0"}, timeout_s=TIMEOUT_S)
    service.fail(_receive(service), code, "the server's own words")  # type: ignore[arg-type]
    with pytest.raises(RemoteError) as excinfo:
        channel.wait(request_id, TIMEOUT_S)
    return excinfo.value


@pytest.mark.parametrize("cls", CODED, ids=lambda cls: cls.code)
def test_each_code_arrives_as_its_class(
    pair: tuple[ServiceSocket, Channel], cls: type[RemoteError]
) -> None:
    error = _refused_with(pair, cls.code)
    assert type(error) is cls
    assert isinstance(error, TensorfleetError)
    assert remote_error_class(cls.code) is cls
    text = str(error)
    address = pair[1].address
    if cls is ServiceRestarted:
        assert (
            text == f"ps:0 at {address} restarted since this task said hello (its answer to 'push')"
        )
    else:
        assert text == f"ps:0 at {address} refused 'push': {cls.code}: the server's own words"


def test_request_refused_is_also_a_value_error_and_deadline_a_timeout(
    pair: tuple[ServiceSocket, Channel],
) -> None:
    assert isinstance(_refused_with(pair, RequestRefused.code), ValueError)
    assert isinstance(_refused_with(pair, RemoteDeadlineExceeded.code), TimeoutError)


@pytest.mark.parametrize("code", ["SomethingNewer", "", 7, None, ["x"], {"a": 1}])
def test_an_unknown_code_raises_plain_remote_error(
    pair: tuple[ServiceSocket, Channel], code: object
) -> None:
    error = _refused_with(pair, code)
    assert type(error) is RemoteError
    label = code if isinstance(code, str) and code else "Error"
    assert str(error).endswith(f"refused 'push': {label}: the server's own words")


# -- the codes a real parameter service sends -----------------------------------------------------

VARIABLES = [{"name": "w", "shape": [2], "dtype": "float32"}]
WORKERS = ("worker:0", "worker:1")


@pytest.fixture
def running(request: pytest.FixtureRequest) -> Iterator[tuple[RunningService, list[Channel]]]:
    """A service (liveness timeout: the indirect parameter, default 15 s) and the channels
    the test opens to it."""
    liveness_s = getattr(request, "param", 15.0)
    handle = serve_in_thread(
        ServiceConfig(shard_index=0, worker_tasks=WORKERS, liveness_timeout_s=liveness_s), SECRET
    )
    channels: list[Channel] = []
    try:
        yield handle, channels
    finally:
        stop_services([handle], channels)


def _channel(running: tuple[RunningService, list[Channel]], task: str, instance: str) -> Channel:
    handle, channels = running
    channel = Channel(handle.address, SECRET, "ps:0")
    channels.append(channel)
    body = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": task}
    channel.call("hello", {**body, "instance": instance}, timeout_s=TIMEOUT_S)
    return channel


def _create(channel: Channel, discipline: UpdateDiscipline) -> None:
    body = {
        "variables": VARIABLES,
        "rule": SGD(lr=0.5).to_wire(),
        "discipline": discipline.to_wire(),
        "task": "worker:0",
    }
    channel.call("create", body, [as_buffer(torch.zeros(2))], timeout_s=CREATE_TIMEOUT_S)


def test_the_service_sends_the_code_of_each_refusal(
    running: tuple[RunningService, list[Channel]],
) -> None:
    chief = _channel(running, "worker:0", "chief-process")
    with pytest.raises(NotInitialized, match="ps:0 has no variables yet"):
        chief.call("pull", {}, timeout_s=TIMEOUT_S)
    with pytest.raises(RemoteProtocolError, match="unknown operation 'reset'"):
        chief.call("reset", {}, timeout_s=TIMEOUT_S)
    with pytest.raises(IdentityInUse, match="worker:0 is already running in another process"):
        _channel(running, "worker:0", "another-process")
    _create(chief, UpdateDiscipline(mode="async"))
    with pytest.raises(RequestRefused, match="variables already created with another layout"):
        chief.call(
            "create",
            {"variables": [{"name": "v", "shape": [3], "dtype": "float32"}], "task": "worker:0"},
            timeout_s=TIMEOUT_S,
        )
    with pytest.raises(RemoteProtocolError, match="gradients: 0 buffers for 1 dtype groups"):
        chief.call("push", {"task": "worker:0"}, timeout_s=TIMEOUT_S)
    stats = chief.call("stats", {}, timeout_s=TIMEOUT_S).body  # and it still serves
    assert stats["refused"] == 4  # the unknown operation is counted apart


@pytest.mark.parametrize("running", [0.5], indirect=True, ids=["liveness 0.5 s"])
def test_a_sync_step_past_its_deadline_and_with_a_lost_worker(
    running: tuple[RunningService, list[Channel]],
) -> None:
    chief = _channel(running, "worker:0", "chief-process")
    _create(chief, UpdateDiscipline(mode="sync", lost_worker="fail"))
    gradients = [as_buffer(torch.ones(2))]
    body = {"task": "worker:0", "step": 0}
    # Held for worker:1, which has not pushed: answered at the request's deadline (0.2 s; the
    # client waits longer for that answer).
    held = chief.send("push", body, gradients, timeout_s=0.2)
    with pytest.raises(RemoteDeadlineExceeded, match="step 0 still waits for gradients from"):
        chief.wait(held, TIMEOUT_S)
    # worker:1 says hello, then falls silent: lost after 0.5 s; the held step fails.
    _channel(running, "worker:1", "worker-1-process")
    with pytest.raises(WorkerLost, match=r"step 0 needs gradients from .*worker:1"):
        chief.call("push", body, gradients, timeout_s=TIMEOUT_S)
