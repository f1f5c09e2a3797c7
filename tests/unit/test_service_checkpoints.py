"""A ps shard's checkpoint operations: a real :class:`ParameterService` served in a background
thread, driven by raw :class:`Channel` s (as in ``test_sync_service.py``).

Covered: ``save`` answers the shard's safetensors document; ``restore`` brings back exactly the
saved values, moving average and global step; a fresh service (a restarted ps) ``create`` s its
variables from the document and then updates bit for bit like the original (the optimizer
state came along); refused restores (another shard's document, other variables, another rule,
garbage, no global step) name the problem and change nothing; a refused create-from-checkpoint
leaves the shard without variables; the workers' data positions sent with ``push`` are saved,
restored and answered to ``create`` / ``wait_ready``; a data position that is not a small map
is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tensorfleet.errors import RemoteError
from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.shard_checkpoint import ShardState, decode_shard, encode_shard
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import SGD, Adam, UpdateRule
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.channel import Channel, Reply
from tensorfleet.wire.tensors import as_buffer

from .service_harness import RunningService, serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(60)

SECRET = b"service-checkpoints-unit-test-secret1"
WORKERS = ("worker:0", "worker:1")
TIMEOUT_S = 5.0
"""Upper bound of every wait that is expected to succeed (they take milliseconds)."""
RULE = Adam(lr=0.05)
DATA = {"epoch": 1, "offset": 64}

#: Two dtype groups: float32 [w (2, 3), b (3,)] and float64 [d (4,)].
VARIABLES = [
    {"name": "w", "shape": [2, 3], "dtype": "float32"},
    {"name": "b", "shape": [3], "dtype": "float32"},
    {"name": "d", "shape": [4], "dtype": "float64"},
]
INITIAL = [
    torch.tensor([0.5, -1.25, 3.0, 1e-3, -0.0, 7.5, 2.0, -4.0, 0.125]),
    torch.tensor([1.0, -2.5, 1e-3, 12345.678], dtype=torch.float64),
]


def _gradients(step: int) -> list[torch.Tensor]:
    """Gradients of push ``step``: not multiples of each other, so Adam's moments matter."""
    scale = 1.0 + 0.37 * step
    return [
        torch.tensor([0.1, 0.2, -0.3, 0.4, 0.5, -0.6, 0.7, 0.8, -0.9]) * scale + 0.01 * step,
        torch.tensor([0.3, -0.1, 2.0, 0.05], dtype=torch.float64) * scale - 0.02 * step,
    ]


# -- a service in a thread, and worker channels --------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[Callable[..., RunningService]]:
    """Start ps:0 services for WORKERS; connect channels with :func:`_channel`. Everything is
    stopped, checked for a crash and closed at teardown."""
    services: list[RunningService] = []
    channels: list[Channel] = []

    def start() -> RunningService:
        config = ServiceConfig(0, WORKERS, idle_timeout_s=60.0, end_grace_s=60.0)
        services.append(serve_in_thread(config, SECRET))
        return services[-1]

    start.channels = channels  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        stop_services(services, channels)


def _channel(
    cluster: Callable[..., RunningService], ps: RunningService, task: str = "worker:0"
) -> Channel:
    channel = Channel(ps.address, SECRET, "ps:0")
    cluster.channels.append(channel)  # type: ignore[attr-defined]
    body = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": task}
    channel.call("hello", body, timeout_s=TIMEOUT_S)
    return channel


def _ps(cluster: Callable[..., RunningService], task: str = "worker:0") -> Channel:
    """A fresh service (like a ps that just started) and a channel to it."""
    return _channel(cluster, cluster(), task)


def _create_body(task: str = "worker:0", ema_decay: float | None = None) -> dict[str, Any]:
    return {
        "variables": VARIABLES,
        "rule": RULE.to_wire(),
        "owns_global_step": True,
        "discipline": UpdateDiscipline(mode="async", ema_decay=ema_decay).to_wire(),
        "task": task,
    }


def _create(channel: Channel, values: list | None = None, **kwargs: Any) -> dict:
    buffers = [as_buffer(v) for v in INITIAL] if values is None else values
    return channel.call("create", _create_body(**kwargs), buffers, TIMEOUT_S).body


def _create_from(
    channel: Channel, document: bytes, global_step: int, task: str = "worker:0", **kwargs: Any
) -> dict:
    body = {**_create_body(task, **kwargs), "restore": True, "global_step": global_step}
    return channel.call("create", body, [document], TIMEOUT_S).body


def _push(channel: Channel, step: int, task: str | None = "worker:0", data: object = None) -> Reply:
    body: dict[str, Any] = {"count_step": True, "want_values": True}
    if task is not None:
        body["task"] = task
    if data is not None:
        body["data"] = data
    buffers = [as_buffer(g) for g in _gradients(step)]
    return channel.call("push", body, buffers, TIMEOUT_S)


def _pull(channel: Channel, moving_average: bool = False) -> Reply:
    return channel.call("pull", {"moving_average": moving_average}, timeout_s=TIMEOUT_S)


def _save(channel: Channel) -> tuple[dict, bytes]:
    reply = channel.call("save", {"task": "worker:0"}, timeout_s=TIMEOUT_S)
    (document,) = reply.buffers
    return reply.body, bytes(memoryview(document))


def _restore(channel: Channel, document: bytes, global_step: object) -> dict:
    body = {"task": "worker:0", "global_step": global_step}
    return channel.call("restore", body, [document], TIMEOUT_S).body


def _bytes(reply: Reply) -> list[bytes]:
    return [bytes(memoryview(b)) for b in reply.buffers]


def _trained(channel: Channel, pushes: int = 2, **create: Any) -> tuple[bytes, list[bytes]]:
    """Create, push ``pushes`` times, save: the document and the values it holds."""
    assert _create(channel, **create)["created"] is True
    for step in range(pushes):
        _push(channel, step)
    body, document = _save(channel)
    assert body == {"global_step": pushes, "version": pushes}
    return document, _bytes(_pull(channel))


def _reencode(document: bytes, **changes: Any) -> bytes:
    """The document with some of its fields replaced (re-encoded, as a valid document)."""
    state: ShardState = decode_shard(document)
    fields = {
        "shard": state.shard,
        "global_step": state.global_step,
        "version": state.version,
        "rule": state.rule,
        "layout": state.layout,
        "values": state.values,
        "ema": state.ema,
        "optimizer": state.optimizer,
        "worker_data": state.worker_data,
    }
    return encode_shard(**{**fields, **changes})


def _wait_ready(channel: Channel, task: str) -> dict:
    body = {"variables": VARIABLES, "task": task}
    return channel.call("wait_ready", body, timeout_s=TIMEOUT_S).body


# -- save and restore ------------------------------------------------------------------------------


def test_save_answers_the_shards_document(cluster: Callable[..., RunningService]) -> None:
    channel = _ps(cluster)
    document, values = _trained(channel)
    state = decode_shard(document)
    assert (state.shard, state.global_step, state.version) == (0, 2, 2)
    assert UpdateRule.from_wire(state.rule) == RULE
    assert [v.to_wire() for v in state.variables] == VARIABLES
    assert state.ema is None
    assert state.worker_data == {}
    assert {name: set(keys) for name, keys in state.optimizer.items()} == {
        name: {"step", "exp_avg", "exp_avg_sq"} for name in ("w", "b", "d")
    }
    float32 = torch.cat([state.values["w"].reshape(-1), state.values["b"]])
    assert [bytes(as_buffer(float32)), bytes(as_buffer(state.values["d"]))] == values


def test_restore_brings_back_the_saved_values_and_global_step(
    cluster: Callable[..., RunningService],
) -> None:
    channel = _ps(cluster)
    document, saved = _trained(channel)
    moved = _push(channel, 2)
    assert moved.body["global_step"] == 3
    assert _bytes(moved) != saved

    assert _restore(channel, document, 2) == {"global_step": 2, "version": 2, "stop": False}

    pulled = _pull(channel)
    assert _bytes(pulled) == saved
    assert (pulled.body["global_step"], pulled.body["version"]) == (2, 2)
    stats = channel.call("stats", {}, timeout_s=TIMEOUT_S).body
    assert (stats["global_step"], stats["refused"]) == (2, 0)


def test_after_a_restore_the_next_push_repeats_the_first_timeline(
    cluster: Callable[..., RunningService],
) -> None:
    channel = _ps(cluster)
    document, _ = _trained(channel)
    first_time = _bytes(_push(channel, 2))
    _push(channel, 3)
    _restore(channel, document, 2)
    assert _bytes(_push(channel, 2)) == first_time


def test_a_restarted_ps_created_from_the_document_continues_bit_for_bit(
    cluster: Callable[..., RunningService],
) -> None:
    original = _ps(cluster)
    document, saved = _trained(original)

    restarted = _ps(cluster)
    created = _create_from(restarted, document, 2)
    assert created == {"created": True, "global_step": 2, "data": None}
    pulled = _pull(restarted)
    assert _bytes(pulled) == saved
    assert (pulled.body["global_step"], pulled.body["version"]) == (2, 2)

    for step in (2, 3):
        expected = _push(original, step)
        got = _push(restarted, step)
        assert _bytes(got) == _bytes(expected), step
        assert got.body["global_step"] == expected.body["global_step"] == step + 1

    # Guard: the same values without the optimizer state would give other bits.
    forgetful = _ps(cluster)
    assert _create(forgetful, values=saved)["created"] is True
    reference = _ps(cluster)
    _create_from(reference, document, 2)
    assert _bytes(_push(forgetful, 2)) != _bytes(_push(reference, 2))


def test_the_moving_average_is_saved_and_restored(cluster: Callable[..., RunningService]) -> None:
    channel = _ps(cluster)
    document, saved = _trained(channel, ema_decay=0.5)
    average = _bytes(_pull(channel, moving_average=True))
    assert average != saved
    assert decode_shard(document).ema is not None
    _push(channel, 2)
    assert _bytes(_pull(channel, moving_average=True)) != average

    _restore(channel, document, 2)
    assert _bytes(_pull(channel, moving_average=True)) == average

    restarted = _ps(cluster)
    _create_from(restarted, document, 2, ema_decay=0.5)
    assert _bytes(_pull(restarted, moving_average=True)) == average


# -- refused restores -------------------------------------------------------------------------------


def _other_shard(document: bytes) -> bytes:
    return _reencode(document, shard=1)


def _other_variables(document: bytes) -> bytes:
    state = decode_shard(document)
    renamed = {"v" if k == "w" else k: t for k, t in state.values.items()}
    variables = [
        StoredVariable("v" if v.name == "w" else v.name, v.shape, v.dtype) for v in state.variables
    ]
    return _reencode(document, layout=FusedLayout.of(variables), values=renamed, optimizer={})


def _other_shape(document: bytes) -> bytes:
    state = decode_shard(document)
    values = {**state.values, "b": torch.zeros(4)}
    variables = [
        StoredVariable(v.name, (4,), v.dtype) if v.name == "b" else v for v in state.variables
    ]
    return _reencode(document, layout=FusedLayout.of(variables), values=values, optimizer={})


def _other_rule(document: bytes) -> bytes:
    return _reencode(document, rule=SGD(lr=0.1).to_wire(), optimizer={})


@pytest.mark.parametrize(
    ("make", "global_step", "match"),
    [
        (
            _other_shard,
            2,
            r"refused 'restore': RequestRefused: the checkpoint's document is of ps:1, this is ps:0",
        ),
        (
            _other_variables,
            2,
            r"refused 'restore': RequestRefused: the checkpoint does not match the variables: "
            r"variable 'w' is not on this shard",
        ),
        (
            _other_shape,
            2,
            r"RequestRefused: the checkpoint does not match the variables: variable 'b' is \[4\]",
        ),
        (
            _other_rule,
            2,
            r"RequestRefused: the checkpoint was made with rule 'sgd', this shard applies 'adam'",
        ),
        (
            lambda document: b"garbage",
            2,
            r"refused 'restore': ProtocolError: a shard document of 7 bytes is too short",
        ),
        (
            lambda document: document[:-10],
            2,
            r"ProtocolError: the shard document's tensors cannot be read",
        ),
        (
            lambda document: document,
            None,
            r"ProtocolError: a restore needs the checkpoint's global_step, got None",
        ),
        (
            lambda document: document,
            -1,
            r"ProtocolError: a restore needs the checkpoint's global_step, got -1",
        ),
    ],
)
def test_a_refused_restore_names_the_problem_and_changes_nothing(
    cluster: Callable[..., RunningService],
    make: Callable[[bytes], bytes],
    global_step: object,
    match: str,
) -> None:
    channel = _ps(cluster)
    document, _ = _trained(channel)
    current = _push(channel, 2, data=DATA)
    bad = make(document)

    with pytest.raises(RemoteError, match=match):
        _restore(channel, bad, global_step)

    pulled = _pull(channel)
    assert _bytes(pulled) == _bytes(current)
    assert (pulled.body["global_step"], pulled.body["version"]) == (3, 3)
    assert _wait_ready(channel, "worker:0")["data"] == DATA
    # and the shard still updates as before the refusal (its optimizer state is intact)
    reference = _ps(cluster)
    _create_from(reference, document, 2)
    _push(reference, 2)
    assert _bytes(_push(channel, 3)) == _bytes(_push(reference, 3))


def test_a_restore_with_two_buffers_is_refused(cluster: Callable[..., RunningService]) -> None:
    channel = _ps(cluster)
    document, saved = _trained(channel)
    body = {"task": "worker:0", "global_step": 2}
    with pytest.raises(RemoteError, match=r"a restore carries one shard document, got 2 buffers"):
        channel.call("restore", body, [document, document], TIMEOUT_S)
    assert _bytes(_pull(channel)) == saved


def test_save_and_restore_before_create_are_refused(cluster: Callable[..., RunningService]) -> None:
    source = _ps(cluster)
    document, _ = _trained(source)
    channel = _ps(cluster)
    with pytest.raises(
        RemoteError, match=r"refused 'save': NotInitialized: ps:0 has no variables yet"
    ):
        _save(channel)
    with pytest.raises(
        RemoteError, match=r"refused 'restore': NotInitialized: ps:0 has no variables"
    ):
        _restore(channel, document, 2)


def test_a_restore_with_misshaped_optimizer_state_is_refused(
    cluster: Callable[..., RunningService],
) -> None:
    channel = _ps(cluster)
    document, saved = _trained(channel)
    state = decode_shard(document)
    optimizer = {name: dict(tensors) for name, tensors in state.optimizer.items()}
    optimizer["w"]["exp_avg"] = optimizer["w"]["exp_avg"].reshape(3, 2).clone()
    with pytest.raises(RemoteError, match=r"optimizer state 'optim/w/exp_avg'"):
        _restore(channel, _reencode(document, optimizer=optimizer), 2)
    assert _bytes(_pull(channel)) == saved


# -- refused create from a checkpoint ------------------------------------------------------------


def _adam_state_without_step(document: bytes) -> bytes:
    """Decodes, but torch's Adam refuses it in load_state_dict (no 'step')."""
    state = decode_shard(document)
    optimizer = {
        name: {k: v for k, v in tensors.items() if k != "step"}
        for name, tensors in state.optimizer.items()
    }
    return _reencode(document, optimizer=optimizer)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (_other_shard, r"refused 'create': RequestRefused: the checkpoint's document is of ps:1"),
        (_other_variables, r"refused 'create': RequestRefused: the checkpoint does not match"),
        (
            _other_rule,
            r"refused 'create': RequestRefused: the checkpoint was made with rule 'sgd', this "
            r"shard applies 'adam'",
        ),
        (
            lambda document: b"\x00" * 64,
            r"refused 'create': ProtocolError: not a tensorfleet shard",
        ),
        (
            _adam_state_without_step,
            r"refused 'create': RequestRefused: the checkpoint's optimizer state does not fit rule "
            r"'adam'",
        ),
    ],
)
def test_a_refused_create_from_a_checkpoint_leaves_the_shard_without_variables(
    cluster: Callable[..., RunningService], make: Callable[[bytes], bytes], match: str
) -> None:
    document, _ = _trained(_ps(cluster))
    channel = _ps(cluster)

    with pytest.raises(RemoteError, match=match):
        _create_from(channel, make(document), 2)

    with pytest.raises(RemoteError, match=r"ps:0 has no variables yet"):
        _pull(channel)
    hello = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": "worker:0"}
    assert channel.call("hello", hello, timeout_s=TIMEOUT_S).body["initialized"] is False
    assert _create(channel) == {"created": True, "global_step": 0, "data": None}
    pulled = _pull(channel)
    assert _bytes(pulled) == [bytes(as_buffer(v)) for v in INITIAL]
    assert (pulled.body["global_step"], pulled.body["version"]) == (0, 0)


def test_a_create_from_a_checkpoint_without_global_step_is_refused(
    cluster: Callable[..., RunningService],
) -> None:
    document, _ = _trained(_ps(cluster))
    channel = _ps(cluster)
    body = {**_create_body(), "restore": True}
    with pytest.raises(
        RemoteError, match=r"a restore needs the checkpoint's global_step, got None"
    ):
        channel.call("create", body, [document], TIMEOUT_S)
    assert _create(channel)["created"] is True


# -- workers' data positions ----------------------------------------------------------------------


def test_a_pushed_data_position_is_saved_and_answered_after_a_restart(
    cluster: Callable[..., RunningService],
) -> None:
    original = _ps(cluster)
    _create(original)
    _push(original, 0)
    _push(original, 1, data=DATA)
    _, document = _save(original)
    assert decode_shard(document).worker_data == {"worker:0": DATA}

    restarted_ps = cluster()
    chief = _channel(cluster, restarted_ps, "worker:1")
    other = _channel(cluster, restarted_ps, "worker:0")
    assert _create_from(chief, document, 2, task="worker:1") == {
        "created": True,
        "global_step": 2,
        "data": None,  # worker:1 reported no position
    }
    assert _wait_ready(other, "worker:0") == {"global_step": 2, "data": DATA}
    assert _wait_ready(chief, "worker:1") == {"global_step": 2, "data": None}
    # create (idempotent) answers the caller's position too
    assert _create(other)["data"] == DATA
    assert decode_shard(_save(other)[1]).worker_data == {"worker:0": DATA}


def test_a_restore_brings_back_the_saved_data_positions(
    cluster: Callable[..., RunningService],
) -> None:
    channel = _ps(cluster)
    _create(channel)
    _push(channel, 0, data=DATA)
    _, document = _save(channel)
    _push(channel, 1, data={"epoch": 2, "offset": 0})
    _push(channel, 2, task="worker:1", data={"epoch": 0, "offset": 8})
    assert _wait_ready(channel, "worker:1")["data"] == {"epoch": 0, "offset": 8}

    _restore(channel, document, 1)

    assert _wait_ready(channel, "worker:0") == {"global_step": 1, "data": DATA}
    assert _wait_ready(channel, "worker:1") == {"global_step": 1, "data": None}


@pytest.mark.parametrize(
    ("task", "data", "match"),
    [
        ("worker:0", [1, 64], r"ProtocolError: worker:0: a data position must be a map, got list"),
        ("worker:0", "epoch 1", r"worker:0: a data position must be a map, got str"),
        ("worker:0", 5, r"worker:0: a data position must be a map, got int"),
        (
            "worker:0",
            {"blob": "x" * 5000},
            r"worker:0: the data position has 5012 bytes as JSON, at most 4096 are kept",
        ),
        (None, DATA, r"ProtocolError: push from unknown task None"),
        ("worker:9", DATA, r"push from unknown task 'worker:9'"),
    ],
)
def test_a_push_with_a_bad_data_position_is_refused_and_not_applied(
    cluster: Callable[..., RunningService], task: str | None, data: object, match: str
) -> None:
    channel = _ps(cluster)
    _create(channel)
    before = _push(channel, 0, data=DATA)

    with pytest.raises(RemoteError, match=match):
        _push(channel, 1, task=task, data=data)

    pulled = _pull(channel)
    assert _bytes(pulled) == _bytes(before)
    assert (pulled.body["global_step"], pulled.body["version"]) == (1, 1)
    assert _wait_ready(channel, "worker:0")["data"] == DATA


def test_the_rule_name_is_recorded_in_the_document(
    cluster: Callable[..., RunningService],
) -> None:
    """The document names the rule the shard applies (here plain SGD, without state)."""
    channel = _ps(cluster)
    body = {**_create_body(), "rule": SGD(lr=0.5).to_wire()}
    channel.call("create", body, [as_buffer(v) for v in INITIAL], TIMEOUT_S)
    _push(channel, 0)
    state = decode_shard(_save(channel)[1])
    assert UpdateRule.from_wire(state.rule) == SGD(lr=0.5)
    assert state.optimizer == {}
