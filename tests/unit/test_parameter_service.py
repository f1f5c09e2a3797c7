"""A real :class:`ParameterService` on a :class:`ServiceSocket` bound to a free loopback port,
served in a background thread, talked to from the test thread with :class:`Channel`,
:class:`ParameterClient` and raw ZeroMQ DEALER sockets (for captured, replayed and garbage
frames).

Every wait has a short deadline, and tests synchronize on replies and notices, not sleeps: a
request on one connection is answered only after everything sent before it on that connection
was handled, so a reply proves the earlier (possibly rejected) messages were processed.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq

from tensorfleet.errors import AuthenticationError, DeadlineExceeded, RemoteError
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ServiceConfig, ServiceOutcome
from tensorfleet.ps.update_rules import SGD, Adagrad, UpdateRule
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.auth import REPLY_ROLE, REQUEST_ROLE, MessageSigner, MessageVerifier
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.service_socket import QUARANTINE_AFTER_INVALID
from tensorfleet.wire.tensors import as_buffer, dtype_name
from tensorfleet.worker import shard_fanout
from tensorfleet.worker.client import ClientTimeouts, ParameterClient

from .service_harness import RunningService, assert_values, bits, serve_in_thread, stop_services

SECRET = b"parameter-service-unit-test-secret-01"
WRONG_SECRET = b"a-different-clusters-secret-000000000"
WORKERS = ("worker:0", "worker:1")
TIMEOUT_S = 5.0
"""Upper bound of every wait that is expected to succeed (they take milliseconds)."""
SHORT_TIMEOUT_S = 0.3
"""Wait for an answer that must not come."""
LR = 0.25

#: Two dtype groups: float32 [w (2, 3), b (3,)] and float64 [d (4,)].
VARIABLES = [
    {"name": "w", "shape": [2, 3], "dtype": "float32"},
    {"name": "b", "shape": [3], "dtype": "float32"},
    {"name": "d", "shape": [4], "dtype": "float64"},
]


def _initial_values() -> list[torch.Tensor]:
    float32 = torch.tensor([0.5, -1.25, 3.0, 1e-3, -0.0, 7.5, 2.0, -4.0, 0.125])
    float64 = torch.tensor([1.0, -2.5, 1e-300, 12345.678], dtype=torch.float64)
    return [float32, float64]


def _gradients(scale: float = 1.0) -> list[torch.Tensor]:
    float32 = torch.tensor([0.1, 0.2, -0.3, 0.4, 0.5, -0.6, 0.7, 0.8, -0.9]) * scale
    float64 = torch.tensor([0.3, -0.1, 2.0, 0.0], dtype=torch.float64) * scale
    return [float32, float64]


def _sgd(values: list[torch.Tensor], *gradient_lists: list[torch.Tensor]) -> list[torch.Tensor]:
    """What torch.optim.SGD(lr=LR) makes of ``values`` after these steps."""
    params = [torch.nn.Parameter(v.clone()) for v in values]
    optimizer = torch.optim.SGD(params, lr=LR)
    for gradients in gradient_lists:
        for param, grad in zip(params, gradients, strict=True):
            param.grad = grad.clone()
        optimizer.step()
    return [p.detach() for p in params]


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def start_service() -> Iterator[Callable[..., RunningService]]:
    """Start services (keyword arguments override :class:`ServiceConfig` fields); each is
    stopped, checked for a crash and closed at teardown."""
    running: list[RunningService] = []

    def start(**overrides: Any) -> RunningService:
        settings = {
            "shard_index": 0,
            "worker_tasks": WORKERS,
            "idle_timeout_s": 60.0,
            "end_grace_s": 60.0,
        }
        running.append(serve_in_thread(ServiceConfig(**{**settings, **overrides}), SECRET))
        return running[-1]

    try:
        yield start
    finally:
        stop_services(running)


@pytest.fixture
def service(start_service: Callable[..., RunningService]) -> RunningService:
    return start_service()


@pytest.fixture
def connect() -> Iterator[Callable[..., Channel]]:
    """Open channels to a service (closed at teardown)."""
    channels: list[Channel] = []

    def open_channel(address: str, secret: bytes = SECRET) -> Channel:
        channel = Channel(address, secret, "ps:0")
        channels.append(channel)
        return channel

    try:
        yield open_channel
    finally:
        for channel in channels:
            channel.close()


class RawPeer:
    """A DEALER socket that signs (or not) what it sends by hand, for replays and garbage."""

    def __init__(self, context: zmq.Context, address: str, secret: bytes = SECRET) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://{address}")
        self.signer = MessageSigner(secret, REQUEST_ROLE)
        self.verifier = MessageVerifier(secret, REPLY_ROLE)
        self.server_session: bytes | None = None
        self._next_id = 0

    def frames(
        self, op: str, body: dict, buffers: list | None = None, header: dict | None = None
    ) -> list:
        """Signed frames of a request; ``header`` overrides fields of the request header."""
        self._next_id += 1
        request = {
            "op": op,
            "id": self._next_id,
            "srv": self.server_session,
            "timeout_ms": int(TIMEOUT_S * 1000),
            "body": body,
            **(header or {}),
        }
        return [
            bytes(f) for f in wire.encode(wire.KIND_REQUEST, request, buffers or [], self.signer)
        ]

    def send(self, frames: list) -> None:
        self.socket.send_multipart(frames)

    def receive(self, timeout_s: float = TIMEOUT_S) -> wire.Message | dict:
        """The next reply (decoded and verified) or notice (a dict)."""
        assert self.socket.poll(int(timeout_s * 1000)), "no answer from the service"
        frames = self.socket.recv_multipart()
        notice = wire.decode_notice(frames)
        if notice is not None:
            return notice
        return wire.decode(frames, wire.KIND_REPLY, self.verifier, wire.Limits())

    def nothing_arrives(self, timeout_s: float = SHORT_TIMEOUT_S) -> bool:
        return not self.socket.poll(int(timeout_s * 1000))

    def call(self, op: str, body: dict, buffers: list | None = None) -> wire.Message:
        """Send a request and return its reply, skipping notices that come first."""
        self.send(self.frames(op, body, buffers))
        while True:
            answer = self.receive()
            if isinstance(answer, wire.Message):
                return answer

    def hello(self) -> None:
        reply = self.call("hello", {"protocol": wire.PROTOCOL_VERSION, "version": __version__})
        assert reply.header["ok"] is True, reply.header
        self.server_session = reply.session_id


@pytest.fixture
def raw_peer() -> Iterator[Callable[..., RawPeer]]:
    context = zmq.Context(io_threads=1)
    peers: list[RawPeer] = []

    def make(address: str, secret: bytes = SECRET) -> RawPeer:
        peers.append(RawPeer(context, address, secret))
        return peers[-1]

    try:
        yield make
    finally:
        for peer in peers:
            peer.socket.close(linger=0)
        context.term()


# -- request helpers --------------------------------------------------------------------------------


def _hello_body(task: str = "worker:0", **overrides: Any) -> dict:
    return {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": task, **overrides}


def _hello(channel: Channel) -> dict:
    return channel.call("hello", _hello_body(), timeout_s=TIMEOUT_S).body


def _create(
    channel: Channel,
    variables: list[dict] = VARIABLES,
    values: list[torch.Tensor] | None = None,
    rule: UpdateRule | None = None,
    owns_global_step: bool = True,
) -> dict:
    values = _initial_values() if values is None else values
    rule = SGD(lr=LR) if rule is None else rule
    body = {"variables": variables, "rule": rule.to_wire(), "owns_global_step": owns_global_step}
    return channel.call("create", body, [as_buffer(v) for v in values], TIMEOUT_S).body


def _pull(channel: Channel) -> tuple[dict, list]:
    reply = channel.call("pull", {}, timeout_s=TIMEOUT_S)
    return reply.body, reply.buffers


def _push(channel: Channel, gradients: list, count_step: bool = True, want_values: bool = True):
    body = {"count_step": count_step, "want_values": want_values}
    return channel.call("push", body, [as_buffer(g) for g in gradients], TIMEOUT_S)


@pytest.fixture
def chief(service: RunningService, connect: Callable[..., Channel]) -> Channel:
    """A channel to ``service`` on which the variables were created."""
    channel = connect(service.address)
    _hello(channel)
    assert _create(channel) == {"created": True, "global_step": 0, "data": None}
    return channel


# -- hello ----------------------------------------------------------------------------------------------


def test_hello_reports_shard_version_and_initialization(
    start_service: Callable[..., RunningService], connect: Callable[..., Channel]
) -> None:
    service = start_service(shard_index=3)
    channel = connect(service.address)
    assert _hello(channel) == {"shard": 3, "version": __version__, "initialized": False}
    _create(channel)
    assert _hello(channel)["initialized"] is True


@pytest.mark.parametrize(
    ("overrides", "seen"),
    [
        ({"version": "9.9.9"}, f"runs tensorfleet 9.9.9 (protocol {wire.PROTOCOL_VERSION})"),
        (
            {"protocol": wire.PROTOCOL_VERSION + 1},
            f"runs tensorfleet {__version__} (protocol {wire.PROTOCOL_VERSION + 1})",
        ),
        ({"version": None}, "runs tensorfleet None"),
    ],
)
def test_hello_with_another_version_is_refused_with_a_clear_error(
    service: RunningService, connect: Callable[..., Channel], overrides: dict, seen: str
) -> None:
    channel = connect(service.address)
    with pytest.raises(RemoteError) as excinfo:
        channel.call("hello", _hello_body("worker:1", **overrides), timeout_s=TIMEOUT_S)
    text = str(excinfo.value)
    assert "refused 'hello': ProtocolError: version mismatch: worker:1 " + seen in text
    assert f"ps:0 runs {__version__} (protocol {wire.PROTOCOL_VERSION})" in text
    assert "install the same tensorfleet version on every task" in text
    assert _hello(channel)["initialized"] is False  # and it keeps serving


def test_unknown_operation_is_refused_by_name(chief: Channel) -> None:
    with pytest.raises(RemoteError, match=r"unknown operation 'reset'; known: \['buffers_create'"):
        chief.call("reset", {}, timeout_s=TIMEOUT_S)


# -- create / pull ----------------------------------------------------------------------------------------


def test_create_then_pull_returns_the_initial_values_bit_for_bit(chief: Channel) -> None:
    body, buffers = _pull(chief)
    assert body == {"global_step": 0, "version": 0, "stop": False}
    assert_values(buffers, _initial_values())


def test_special_float_bit_patterns_survive_create_and_pull(
    service: RunningService, connect: Callable[..., Channel]
) -> None:
    nan_with_payload = torch.tensor([0x7FC12345], dtype=torch.int32).view(torch.float32)
    float32 = torch.cat([nan_with_payload, torch.tensor([-0.0, float("inf"), 1e-45, -3.0])])
    variables = [{"name": "x", "shape": [5], "dtype": "float32"}]
    variables.append({"name": "h", "shape": [2, 2], "dtype": "bfloat16"})
    bfloat16 = torch.tensor([1.5, float("-inf"), -0.0, 3.0e38], dtype=torch.bfloat16)
    channel = connect(service.address)
    _hello(channel)
    _create(channel, variables, [float32, bfloat16])
    _, buffers = _pull(channel)
    assert_values(buffers, [float32, bfloat16])


def test_create_is_idempotent_and_keeps_the_first_values(chief: Channel) -> None:
    other_values = [v + 1 for v in _initial_values()]
    assert _create(chief, values=other_values) == {"created": False, "global_step": 0, "data": None}
    _push(chief, _gradients())
    assert _create(chief, values=other_values) == {"created": False, "global_step": 1, "data": None}
    _, buffers = _pull(chief)
    assert_values(buffers, _sgd(_initial_values(), _gradients()))


@pytest.mark.parametrize(
    ("variables", "difference"),
    [
        (
            [VARIABLES[0], {"name": "b", "shape": [4], "dtype": "float32"}, VARIABLES[2]],
            "variable 'b' is [3] float32 on the ps, [4] float32 in the model",
        ),
        (VARIABLES[:2], "this shard holds 'd', which the model does not have here"),
        ([*VARIABLES, {"name": "e", "shape": [1], "dtype": "float32"}], "variable 'e' is not"),
        ([VARIABLES[1], VARIABLES[0], VARIABLES[2]], "the variables are in a different order"),
    ],
)
def test_create_with_a_different_layout_is_refused_naming_the_variable(
    chief: Channel, variables: list[dict], difference: str
) -> None:
    with pytest.raises(RemoteError) as excinfo:
        _create(chief, variables)
    assert "variables already created with another layout: " + difference in str(excinfo.value)
    _, buffers = _pull(chief)
    assert_values(buffers, _initial_values())


@pytest.mark.parametrize(
    ("variables", "values", "rule", "match"),
    [
        (VARIABLES, _initial_values()[:1], SGD(lr=LR), "initial values: 1 buffers for 2"),
        (
            VARIABLES,
            [_initial_values()[0][:-1], _initial_values()[1]],
            SGD(lr=LR),
            "has 32 bytes, .* need 36",
        ),
        ("w", [], SGD(lr=LR), "'variables' must be a list of 0.."),
        (
            [{"name": "i", "shape": [1], "dtype": "int64"}],
            [torch.zeros(1, dtype=torch.int64)],
            SGD(lr=LR),
            "trainable dtypes",
        ),
        (VARIABLES, _initial_values(), SGD(lr=-1.0), "Invalid learning rate"),
    ],
    ids=["buffer-count", "buffer-size", "not-a-list", "int-dtype", "bad-lr"],
)
def test_invalid_create_is_refused_and_the_service_keeps_serving(
    service: RunningService,
    connect: Callable[..., Channel],
    variables: list[dict],
    values: list[torch.Tensor],
    rule: UpdateRule,
    match: str,
) -> None:
    channel = connect(service.address)
    _hello(channel)
    with pytest.raises(RemoteError, match=match):
        _create(channel, variables, values, rule)
    assert _hello(channel)["initialized"] is False
    assert _create(channel) == {"created": True, "global_step": 0, "data": None}


def test_a_shard_without_variables_is_created_and_answers_pushes_and_pulls(
    service: RunningService, connect: Callable[..., Channel]
) -> None:
    """A shard whose part of the model is only embedding-table rows holds no variable."""
    channel = connect(service.address)
    _hello(channel)
    assert _create(channel, [], [], Adagrad(lr=0.1))["created"] is True
    assert _hello(channel)["initialized"] is True
    reply = _push(channel, [])
    assert reply.buffers == [] and reply.body["made_step"] is True
    assert _pull(channel)[1] == []


@pytest.mark.parametrize(
    ("rule", "match"),
    [
        (
            {"name": "sgd", "hyperparameters": {"lr": "x"}},
            "hyperparameter lr='x' has the wrong type",
        ),
        ({"name": "adam", "hyperparameters": {"betas": [0.9]}}, "must be a pair of numbers"),
    ],
    ids=["string-lr", "short-betas"],
)
def test_malformed_rule_on_the_wire_is_refused(
    service: RunningService, connect: Callable[..., Channel], rule: dict, match: str
) -> None:
    channel = connect(service.address)
    _hello(channel)
    body = {"variables": VARIABLES, "rule": rule}
    buffers = [as_buffer(v) for v in _initial_values()]
    with pytest.raises(RemoteError, match=f"RequestRefused: .*{match}"):
        channel.call("create", body, buffers, TIMEOUT_S)
    assert _create(channel) == {"created": True, "global_step": 0, "data": None}


@pytest.mark.parametrize("op", ["pull", "push"])
def test_pull_and_push_before_create_are_refused(
    service: RunningService, connect: Callable[..., Channel], op: str
) -> None:
    channel = connect(service.address)
    _hello(channel)
    buffers = [as_buffer(g) for g in _gradients()] if op == "push" else []
    with pytest.raises(RemoteError, match="ps:0 has no variables yet"):
        channel.call(op, {}, buffers, TIMEOUT_S)


# -- wait_ready -------------------------------------------------------------------------------------------


def test_wait_ready_sent_before_create_is_answered_after_create(
    service: RunningService, connect: Callable[..., Channel]
) -> None:
    worker, chief = connect(service.address), connect(service.address)
    _hello(worker)
    waiting = worker.send(
        "wait_ready", {"variables": VARIABLES, "task": "worker:1"}, None, TIMEOUT_S
    )
    # The stats reply comes after wait_ready was handled (same connection, handled in order),
    # so wait_ready is held at the service, not lost or answered.
    assert worker.call("stats", {}, timeout_s=TIMEOUT_S).body["pushes"] == 0
    assert worker.dropped == {}
    assert waiting not in worker._arrived  # held at the service, not answered yet

    _hello(chief)
    _create(chief)
    _push(chief, _gradients())  # the held request is answered at create, before this push
    assert worker.wait(waiting, TIMEOUT_S).body == {"global_step": 0, "data": None}
    _, buffers = _pull(worker)
    assert_values(buffers, _sgd(_initial_values(), _gradients()))


def test_wait_ready_after_create_is_answered_at_once(chief: Channel) -> None:
    reply = chief.call("wait_ready", {"variables": VARIABLES, "task": "worker:1"}, None, TIMEOUT_S)
    assert reply.body == {"global_step": 0, "data": None}


@pytest.mark.parametrize("before_create", [True, False], ids=["held", "after-create"])
def test_wait_ready_with_a_different_model_is_refused_naming_the_difference(
    service: RunningService, connect: Callable[..., Channel], before_create: bool
) -> None:
    worker, chief = connect(service.address), connect(service.address)
    _hello(worker)
    _hello(chief)
    other_model = [VARIABLES[0], VARIABLES[1], {"name": "d", "shape": [2, 2], "dtype": "float32"}]
    body = {"variables": other_model, "task": "worker:1"}
    if before_create:
        waiting = worker.send("wait_ready", body, None, TIMEOUT_S)
        worker.call("stats", {}, timeout_s=TIMEOUT_S)
        _create(chief)
    else:
        _create(chief)
        waiting = worker.send("wait_ready", body, None, TIMEOUT_S)
    with pytest.raises(RemoteError) as excinfo:
        worker.wait(waiting, TIMEOUT_S)
    assert (
        "the model of worker:1 does not match the chief's: "
        "variable 'd' is [4] float64 on the ps, [2, 2] float32 in the model"
    ) in str(excinfo.value)


# -- push -----------------------------------------------------------------------------------------------


def test_push_applies_sgd_exactly_and_the_owner_counts_global_steps(chief: Channel) -> None:
    first = _push(chief, _gradients())
    assert first.body == {
        "global_step": 1,
        "version": 1,
        "stop": False,
        "made_step": True,
        "dropped": False,
    }
    assert_values(first.buffers, _sgd(_initial_values(), _gradients()))

    second = _push(chief, _gradients(-0.5), count_step=False)
    assert second.body == {
        "global_step": 1,
        "version": 2,
        "stop": False,
        "made_step": True,
        "dropped": False,
    }
    expected = _sgd(_initial_values(), _gradients(), _gradients(-0.5))
    assert_values(second.buffers, expected)

    third = _push(chief, _gradients(2.0), want_values=False)
    assert third.body == {
        "global_step": 2,
        "version": 3,
        "stop": False,
        "made_step": True,
        "dropped": False,
    }
    assert third.buffers == []
    body, buffers = _pull(chief)
    assert body == {"global_step": 2, "version": 3, "stop": False}
    assert_values(buffers, _sgd(_initial_values(), _gradients(), _gradients(-0.5), _gradients(2.0)))
    assert chief.call("stats", {}, timeout_s=TIMEOUT_S).body["pushes"] == 3


def test_a_shard_that_does_not_own_the_global_step_never_counts_it(
    service: RunningService, connect: Callable[..., Channel]
) -> None:
    channel = connect(service.address)
    _hello(channel)
    _create(channel, owns_global_step=False)
    for _ in range(3):
        reply = _push(channel, _gradients(), count_step=True)
    assert reply.body["global_step"] == 0 and reply.body["version"] == 3


@pytest.mark.parametrize(
    "gradients",
    [
        [_gradients()[0][:-1], _gradients()[1]],
        [_gradients()[0], torch.zeros(5, dtype=torch.float64)],
        [_gradients()[0]],
        [*_gradients(), torch.zeros(1)],
        [torch.zeros(9, dtype=torch.float64), torch.zeros(4, dtype=torch.float32)],
        [],
    ],
    ids=["short", "long", "missing-buffer", "extra-buffer", "swapped-dtypes", "no-buffers"],
)
def test_push_with_wrong_buffers_is_refused_and_changes_nothing(
    service: RunningService, chief: Channel, gradients: list[torch.Tensor]
) -> None:
    _push(chief, _gradients())
    with pytest.raises(RemoteError, match="refused 'push': ProtocolError: gradients: "):
        _push(chief, gradients)
    body, buffers = _pull(chief)
    assert body == {"global_step": 1, "version": 1, "stop": False}
    assert_values(buffers, _sgd(_initial_values(), _gradients()))
    # The next valid request is served as usual.
    assert _push(chief, _gradients(3.0)).body["version"] == 2
    assert service.service.stats["refused"] == 1


# -- authentication -----------------------------------------------------------------------------------


def test_client_with_the_wrong_secret_is_told_and_cannot_push_or_pull(
    service: RunningService, chief: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the intruder's first message is explained (one notice per peer); its later
    requests go unanswered, so each wait lasts its deadline plus the margin a client leaves
    for a server's explanation (``ANSWER_MARGIN_S``, 2 s). No explanation can come here,
    so the margin is cut to a tenth of a second: its five waits would otherwise add 10 s."""
    monkeypatch.setattr(shard_fanout, "ANSWER_MARGIN_S", 0.1)
    timeouts = ClientTimeouts(
        connect_s=TIMEOUT_S,
        initialize_s=SHORT_TIMEOUT_S,
        step_s=SHORT_TIMEOUT_S,
        recover_s=SHORT_TIMEOUT_S,
    )
    intruder = ParameterClient([service.address], WRONG_SECRET, "worker:1", timeouts)
    try:
        with pytest.raises(AuthenticationError) as excinfo:
            intruder.connect()
        text = str(excinfo.value)
        assert text.startswith("secret mismatch: ps:0 at " + service.address)
        assert "does not hold this cluster's secret" in text
        assert "TENSORFLEET_SECRET" in text

        params = {
            "w": torch.nn.Parameter(torch.zeros(2, 3)),
            "b": torch.nn.Parameter(torch.zeros(3)),
        }
        params["d"] = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        specs = [
            VariableSpec(n, tuple(p.shape), dtype_name(p.dtype), p.element_size())
            for n, p in params.items()
        ]
        plan = plan_placement(specs, 1)
        with pytest.raises(DeadlineExceeded, match="has not initialized the variables"):
            intruder.register(list(params.items()), plan, SGD(lr=LR), is_chief=False)
        for param in params.values():
            param.grad = torch.full_like(param, 1000.0)
        with pytest.raises(DeadlineExceeded, match="did not come back"):
            intruder.push_pull()  # tries to recover (hello again), cannot
        with pytest.raises(DeadlineExceeded, match="did not come back"):
            intruder.pull()
    finally:
        intruder.close()

    body, buffers = _pull(chief)
    assert body == {"global_step": 0, "version": 0, "stop": False}
    assert_values(buffers, _initial_values())
    # hello, wait_ready, push, pull, the hellos of recovery and of the heartbeat: all refused
    assert set(service.rejected) == {"auth"} and service.rejected["auth"] >= 4
    assert set(chief.call("stats", {}, timeout_s=TIMEOUT_S).body["rejected"]) == {"auth"}


def test_a_secret_mismatch_says_where_this_tasks_secret_came_from(
    service: RunningService, tmp_path
) -> None:
    """A new user's worker given ``--secret-file wrong-secret`` was told only that the
    secrets differ; it is now told which of its secrets it used."""
    from tensorfleet.wire.secret import load_secret

    path = tmp_path / "wrong-secret"
    path.write_bytes(WRONG_SECRET)
    path.chmod(0o600)
    secret = load_secret(secret_file=path, environ={})
    assert secret == WRONG_SECRET and str(path) in repr(secret)
    for shown in (repr(secret), str(secret), f"{secret}"):
        assert WRONG_SECRET.decode() not in shown, shown  # never the bytes themselves
    intruder = ParameterClient(
        [service.address], secret, "worker:1", ClientTimeouts(connect_s=TIMEOUT_S)
    )
    try:
        with pytest.raises(AuthenticationError) as excinfo:
            intruder.connect()
    finally:
        intruder.close()
    assert f"this task's secret came from secret file {path}." in str(excinfo.value)
    from_env = load_secret(environ={"TENSORFLEET_SECRET": WRONG_SECRET.decode()})
    assert from_env.source == "$TENSORFLEET_SECRET"
    assert load_secret(from_env).source == "$TENSORFLEET_SECRET"  # tfl.Server loads it again
    assert load_secret(WRONG_SECRET).source == "the secret argument"


def test_well_formed_push_signed_with_another_secret_is_not_applied(
    service: RunningService, chief: Channel, raw_peer: Callable[..., RawPeer]
) -> None:
    intruder = raw_peer(service.address, WRONG_SECRET)
    intruder.server_session = _session_of(service)
    intruder.send(
        intruder.frames("push", {"count_step": True}, [as_buffer(g) for g in _gradients()])
    )
    notice = intruder.receive()
    assert notice["reason"] == "auth"
    assert intruder.nothing_arrives()  # refused, not answered
    body, buffers = _pull(chief)
    assert body["version"] == 0 and body["global_step"] == 0
    assert_values(buffers, _initial_values())
    assert service.rejected == {"auth": 1}


def _session_of(service: RunningService) -> bytes:
    return service.service.socket.session_id


def test_replayed_push_is_rejected_on_the_same_and_on_another_connection(
    service: RunningService, chief: Channel, raw_peer: Callable[..., RawPeer]
) -> None:
    peer = raw_peer(service.address)
    peer.hello()
    captured = peer.frames(
        "push", {"count_step": True, "want_values": True}, [as_buffer(g) for g in _gradients()]
    )
    peer.send(captured)
    applied = peer.receive()
    assert applied.header["ok"] is True
    assert applied.header["body"] == {
        "global_step": 1,
        "version": 1,
        "stop": False,
        "made_step": True,
        "dropped": False,
    }
    after_one_push = _sgd(_initial_values(), _gradients())

    peer.send(captured)  # the exact same frames again
    notice = peer.receive()
    assert notice["reason"] == "auth" and "replayed" in notice["message"]
    pulled = peer.call("pull", {})  # answered after the replay was handled
    assert pulled.header["body"] == {"global_step": 1, "version": 1, "stop": False}
    assert_values(pulled.buffers, after_one_push)

    other = raw_peer(service.address)
    other.send(captured)
    notice = other.receive()
    assert notice["reason"] == "auth" and "replayed" in notice["message"]
    assert other.nothing_arrives()

    body, buffers = _pull(chief)
    assert body == {"global_step": 1, "version": 1, "stop": False}
    assert_values(buffers, after_one_push)
    # counted and logged as replays, not as a wrong secret (the peer's notice stays "auth")
    assert service.rejected == {"replayed": 2}


def test_request_addressed_to_another_service_session_is_refused_as_stale(
    service: RunningService, chief: Channel, raw_peer: Callable[..., RawPeer]
) -> None:
    """A valid request meant for an earlier incarnation (the ps restarted) is not applied;
    its sender is told at once to say hello again, and it does not count as invalid."""
    peer = raw_peer(service.address)
    peer.server_session = b"\x00" * 16  # an earlier incarnation of the service
    peer.send(peer.frames("push", {}, [as_buffer(g) for g in _gradients()]))
    reply = peer.receive()
    assert isinstance(reply, wire.Message)
    assert reply.header["ok"] is False and reply.header["error_type"] == "StaleSession"
    assert service.rejected == {"stale": 1}
    assert _pull(chief)[0]["version"] == 0


# -- garbage -----------------------------------------------------------------------------------------------


def _envelope(protocol: int = wire.PROTOCOL_VERSION, header_len: int = 4) -> bytes:
    fields = (
        wire.MAGIC,
        protocol,
        wire.KIND_REQUEST,
        os.urandom(16),
        1,
        header_len,
        os.urandom(16),
    )
    return struct.pack(">2sBB16sQI16s", *fields)


def _wait_until(
    condition: Callable[[], bool], describe: Callable[[], str], timeout_s: float = 10.0
) -> None:
    """Poll ``condition`` (state owned by the service thread) until true or the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {timeout_s} s: {describe()}"
        time.sleep(0.01)


def test_garbage_frames_do_not_crash_the_service(
    service: RunningService, chief: Channel, raw_peer: Callable[..., RawPeer]
) -> None:
    peer = raw_peer(service.address)
    malformed = [
        [b""],
        [b"hello"],
        [b"\x00" * wire.ENVELOPE_BYTES, b""],
        [os.urandom(wire.ENVELOPE_BYTES), os.urandom(100), os.urandom(7)],
        [_envelope(header_len=5), b"four"],
        [_envelope(), b"four", *([b"x"] * 1100)],
        [*wire.encode_notice("auth", "a notice is not a request")],
        # Signed with the right secret (each by a session of its own, since connections are
        # not served in order and one session's counters must arrive in order), but not a
        # valid request header:
        *(
            raw_peer(service.address).frames("hello", {}, None, bad_field)
            for bad_field in (
                {"op": None},
                {"id": "1"},
                {"body": [1, 2]},
                {"timeout_ms": -1},
                {"timeout_ms": 10**15},
            )
        ),
        raw_peer(service.address).frames("pull", {}),  # not addressed to this service's session
    ]
    other_protocol = [_envelope(protocol=wire.PROTOCOL_VERSION + 1), b"four", b""]
    bad_tag = [_envelope(), b"four", b""]
    # Each kind on a connection of its own, so that every one is examined. Connections are
    # served fairly, not in order, so wait for the service's own counts (with a deadline).
    for frames in [*malformed, other_protocol, bad_tag]:
        one_shot = raw_peer(service.address)
        one_shot.send(frames)
    # The last one is authentic but addressed to another session: answered, counted as stale.
    expected = {"malformed": len(malformed) - 1, "stale": 1, "protocol": 1, "auth": 1}
    _wait_until(lambda: service.rejected == expected, lambda: f"rejected: {service.rejected}")

    # A connection that keeps sending garbage is ignored from then on (quarantined)...
    for _ in range(QUARANTINE_AFTER_INVALID + 3):
        peer.send(bad_tag)
    _wait_until(
        lambda: service.rejected.get("quarantined", 0) == 3, lambda: f"rejected: {service.rejected}"
    )
    notice = peer.socket.recv_multipart() if peer.socket.poll(5000) else None
    assert notice is not None and wire.decode_notice(notice) is not None, "one notice, then silence"
    peer.send(peer.frames("hello", {"protocol": wire.PROTOCOL_VERSION}))
    _wait_until(
        lambda: service.rejected.get("quarantined", 0) == 4, lambda: f"rejected: {service.rejected}"
    )
    assert not peer.socket.poll(200), "a quarantined connection gets no answer"
    # ... while everyone else is still served.
    raw_peer(service.address).hello()
    # A valid client is served as usual, and the variables are untouched.
    body, buffers = _pull(chief)
    assert body["version"] == 0
    assert_values(buffers, _initial_values())
    assert _push(chief, _gradients()).body["version"] == 1


def test_peer_of_another_protocol_version_is_told_once(
    service: RunningService, raw_peer: Callable[..., RawPeer]
) -> None:
    peer = raw_peer(service.address)
    frames = peer.frames("hello", _hello_body())
    envelope = bytearray(frames[0])
    envelope[2] = wire.PROTOCOL_VERSION + 1
    peer.send([bytes(envelope), *frames[1:]])
    notice = peer.receive()
    error = wire.notice_error(notice, "ps:0")
    assert notice["reason"] == "protocol"
    assert f"protocol version {wire.PROTOCOL_VERSION + 1} received" in str(error)
    peer.send([bytes(envelope), *frames[1:]])
    assert peer.nothing_arrives()  # one notice per peer, not one per message
    assert service.rejected == {"protocol": 2}


# -- how serve() ends ------------------------------------------------------------------------------------


def test_done_from_every_worker_finishes_the_service(
    service: RunningService, chief: Channel, connect: Callable[..., Channel]
) -> None:
    _push(chief, _gradients())
    with pytest.raises(RemoteError, match=r"ProtocolError: done from unknown task 'worker:9'"):
        chief.call("done", {"task": "worker:9"}, timeout_s=TIMEOUT_S)
    assert chief.call("done", {"task": "worker:0"}, timeout_s=TIMEOUT_S).body == {}
    assert chief.call("done", {"task": "worker:0"}, timeout_s=TIMEOUT_S).body == {}
    assert service.thread.is_alive()
    stats = chief.call("stats", {}, timeout_s=TIMEOUT_S).body
    assert stats["done_workers"] == ["worker:0"]
    other = connect(service.address)
    _hello(other)
    assert other.call("done", {"task": "worker:1"}, timeout_s=TIMEOUT_S).body == {}
    outcome = service.outcome()
    assert outcome == ServiceOutcome("finished", 1) and outcome.clean


def test_parameter_clients_finish_the_service(
    service: RunningService,
) -> None:
    # finish_s: the chief waits that long for worker:1, which finishes after it in this test
    # (the default, 120 s within the ps's 60 s grace, would wait 50 s for nothing).
    timeouts = ClientTimeouts(
        connect_s=TIMEOUT_S, initialize_s=TIMEOUT_S, step_s=TIMEOUT_S, finish_s=1.0
    )
    models = [
        [("w", torch.nn.Parameter(torch.ones(4, 2))), ("b", torch.nn.Parameter(torch.zeros(2)))]
        for _ in WORKERS
    ]
    specs = [VariableSpec(n, tuple(p.shape), "float32", 4) for n, p in models[0]]
    plan = plan_placement(specs, 1)
    clients = [ParameterClient([service.address], SECRET, task, timeouts) for task in WORKERS]
    try:
        for client in clients:
            client.connect()
        assert clients[0].register(models[0], plan, SGD(lr=LR), is_chief=True) == 0
        assert clients[1].register(models[1], plan, SGD(lr=LR), is_chief=False) == 0
        for _, param in models[0]:
            param.grad = torch.ones_like(param)
        progress = clients[0].push_pull()
        assert progress.global_step == 1 and progress.stop is False
        assert torch.equal(models[0][0][1].detach(), torch.full((4, 2), 1 - LR))
        assert torch.equal(models[0][1][1].detach(), torch.full((2,), -LR))
        assert clients[1].pull().global_step == 1
        assert torch.equal(models[1][0][1].detach(), torch.full((4, 2), 1 - LR))

        assert clients[0].finish(declare_end=True) == ["worker:1"]  # still running then
        assert clients[1].pull().stop is True  # the chief declared the end
        clients[1].finish(declare_end=False)
    finally:
        for client in clients:
            client.close()
    assert service.outcome() == ServiceOutcome("finished", 1)


def test_two_shards_with_a_partitioned_variable_match_local_sgd(
    start_service: Callable[..., RunningService],
) -> None:
    shards = [start_service(shard_index=i) for i in range(2)]
    generator = torch.Generator().manual_seed(7)
    initial = {
        "emb": torch.randn(6, 2, generator=generator),
        "w": torch.randn(3, generator=generator, dtype=torch.float64),
        "b": torch.tensor(0.5),
    }
    model = [(name, torch.nn.Parameter(value.clone())) for name, value in initial.items()]
    reference = [torch.nn.Parameter(value.clone()) for value in initial.values()]
    optimizer = torch.optim.SGD(reference, lr=LR, momentum=0.5)
    specs = [
        VariableSpec(name, tuple(p.shape), dtype_name(p.dtype), p.element_size())
        for name, p in model
    ]
    plan = plan_placement(specs, 2, partition_threshold_bytes=24)  # emb: 48 B, w: 24 B
    stored = sorted(piece.stored_name for shard in plan.shards for piece in shard)
    assert stored == ["b", "emb/part_0", "emb/part_1", "w"]

    timeouts = ClientTimeouts(connect_s=TIMEOUT_S, initialize_s=TIMEOUT_S, step_s=TIMEOUT_S)
    client = ParameterClient([s.address for s in shards], SECRET, "worker:0", timeouts)
    try:
        client.connect()
        client.register(model, plan, UpdateRule("sgd", {"lr": LR, "momentum": 0.5}), True)
        for step in range(3):
            for (_, param), ref in zip(model, reference, strict=True):
                grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)
                param.grad, ref.grad = grad.clone(), grad.clone()
            optimizer.step()
            progress = client.push_pull()
            assert progress.global_step == step + 1
            for (name, param), ref in zip(model, reference, strict=True):
                assert bits(param.detach()) == bits(ref.detach()), f"{name} at step {step}"
        stats = client.stats()
    finally:
        client.close()
    # Only shard 0 counts the global step; both applied every push.
    assert [s["global_step"] for s in stats] == [3, 0]
    assert [s["version"] for s in stats] == [3, 3]


def test_the_chief_does_not_wait_for_a_worker_that_never_joined_and_both_ends_name_it(
    start_service: Callable[..., RunningService],
    raw_peer: Callable[..., RawPeer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker whose messages were all refused (another secret), or that never started, has
    no push to finish: the chief ends at once, saying so, instead of waiting its whole
    finish_s for a worker 'still running'; the ps's grace period (for a late worker to learn
    that training is over) names it as never heard from, with the messages it refused."""
    service = start_service(end_grace_s=0.5)
    timeouts = ClientTimeouts(
        connect_s=TIMEOUT_S, initialize_s=TIMEOUT_S, step_s=TIMEOUT_S, finish_s=TIMEOUT_S
    )
    model = [("w", torch.nn.Parameter(torch.ones(4, 2)))]
    plan = plan_placement([VariableSpec("w", (4, 2), "float32", 4)], 1)
    chief = ParameterClient([service.address], SECRET, "worker:0", timeouts)
    intruder = raw_peer(service.address, WRONG_SECRET)  # worker:1 with another secret
    intruder.send(intruder.frames("hello", _hello_body("worker:1")))
    assert intruder.receive()["reason"] == "auth"
    try:
        chief.connect()
        chief.register(model, plan, SGD(lr=LR), is_chief=True)
        with caplog.at_level("WARNING"):
            # not waited for (it was named among the workers still running, and waited for)
            assert chief.finish(declare_end=True) == []
    finally:
        chief.close()
    assert service.outcome() == ServiceOutcome("ended", 0)
    text = caplog.text
    assert "worker:1 never reached the parameter servers" in text, text
    assert "worker:1: never heard from, not started or refused" in text, text
    assert "'auth': 1" in text, text


def test_end_and_grace_period_end_the_service(
    start_service: Callable[..., RunningService], connect: Callable[..., Channel]
) -> None:
    service = start_service(end_grace_s=0.3)
    channel = connect(service.address)
    _hello(channel)
    _create(channel)
    declared = time.monotonic()
    assert channel.call("end", {}, timeout_s=TIMEOUT_S).body == {"grace_s": 0.3}
    assert _push(channel, _gradients()).body["stop"] is True
    channel.call("done", {"task": "worker:0"}, timeout_s=TIMEOUT_S)  # worker:1 never says done
    outcome = service.outcome()
    assert outcome == ServiceOutcome("ended", 1) and outcome.clean
    assert time.monotonic() - declared >= 0.3


@pytest.mark.parametrize("owns_global_step", [True, False])
def test_the_end_is_logged_with_the_global_step_only_where_the_shard_counts_it(
    start_service: Callable[..., RunningService],
    connect: Callable[..., Channel],
    caplog: pytest.LogCaptureFixture,
    owns_global_step: bool,
) -> None:
    """A shard that does not count the global step (every shard but the chief's first, in
    async mode) logged "at global step 0" at the end of a run of hundreds of steps."""
    service = start_service(end_grace_s=0.2)
    channel = connect(service.address)
    _hello(channel)
    _create(channel, owns_global_step=owns_global_step)
    for _ in range(2):
        _push(channel, _gradients())
    with caplog.at_level("INFO", logger="tensorfleet.ps"):
        channel.call("end", {}, timeout_s=TIMEOUT_S)
        channel.call("done", {"task": "worker:0"}, timeout_s=TIMEOUT_S)
        service.outcome()
    ends = [r.getMessage() for r in caplog.records if "training over" in r.getMessage()]
    expected = (
        "at global step 2" if owns_global_step else "after 2 pushes applied here (another shard"
    )
    assert ends and all(expected in line for line in ends), ends
    # async: the push ages in a few words (tensorfleet.ps.gradient_age); these pushes named none
    assert all(
        line.endswith("; pushes up to 0 updates old applied, none dropped (max_gradient_age=64)")
        for line in ends
    ), ends


def test_idle_timeout_ends_the_service_and_rejected_messages_do_not_count_as_activity(
    start_service: Callable[..., RunningService], raw_peer: Callable[..., RawPeer]
) -> None:
    service = start_service(idle_timeout_s=0.5)
    started = time.monotonic()
    intruder = raw_peer(service.address, WRONG_SECRET)
    intruder.send(intruder.frames("hello", _hello_body()))
    assert intruder.receive()["reason"] == "auth"
    outcome = service.outcome()
    assert outcome == ServiceOutcome("idle", 0) and not outcome.clean
    assert time.monotonic() - started >= 0.5
    assert service.rejected == {"auth": 1}


def test_stop_event_stops_the_service(service: RunningService) -> None:
    service.stop.set()
    assert service.outcome() == ServiceOutcome("stopped", 0)


def test_service_config_is_validated() -> None:
    with pytest.raises(ValueError, match="idle_timeout_s and liveness_timeout_s must be > 0"):
        ServiceConfig(shard_index=0, worker_tasks=WORKERS, idle_timeout_s=0)
    with pytest.raises(ValueError, match="end_grace_s >= 0"):
        ServiceConfig(shard_index=0, worker_tasks=WORKERS, end_grace_s=-1)


def test_a_channel_counts_the_bytes_of_its_requests_and_replies(chief: Channel) -> None:
    """``bytes_sent`` / ``bytes_received``: headers and payloads of the requests and of the
    valid replies (what the sparse-table benchmark reports per step)."""
    sent0, received0 = chief.bytes_sent, chief.bytes_received
    gradients = [torch.ones_like(v) for v in _initial_values()]
    payload = sum(g.numel() * g.element_size() for g in gradients)
    _push(chief, gradients, want_values=True)  # the reply carries the new values
    sent, received = chief.bytes_sent - sent0, chief.bytes_received - received0
    assert payload < sent < payload + 1024, (payload, sent)
    assert payload < received < payload + 1024, (payload, received)
    _push(chief, gradients, want_values=False)
    assert chief.bytes_received - received0 - received < 1024  # no values this time
