"""Partial pushes on a real ps (tensorfleet.ps.partial_push): a step pushed as buckets of its
variables moves the shard exactly as the whole push does, bit for bit (values, Adam's
per-variable step counts, the moving average, the global step), also when the worker sends
bf16 gradients with error feedback, and a malformed bucket is refused with a typed error
while the shard goes on serving.

A real :class:`ParameterService` in a thread, talked to with a :class:`Channel`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tensorfleet.errors import RemoteProtocolError, RequestRefused
from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import SGD, Adagrad, Adam, UpdateRule
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.gradient_encoding import ErrorFeedback
from tensorfleet.wire.tensors import as_buffer, from_buffer

from .service_harness import RunningService, bits, serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(60)

SECRET = b"partial-push-unit-test-secret-0000000001"
TIMEOUT_S = 5.0

#: float32 [w (2, 3), b (3,)], float64 [d (4,)], float32 [e (2,)]: the float32 group's members
#: are variables 0, 1 and 3, so a part can take a slice of a group with a gap in its indices.
VARIABLES = [
    {"name": "w", "shape": [2, 3], "dtype": "float32"},
    {"name": "b", "shape": [3], "dtype": "float32"},
    {"name": "d", "shape": [4], "dtype": "float64"},
    {"name": "e", "shape": [2], "dtype": "float32"},
]
LAYOUT = FusedLayout.of([StoredVariable.from_wire(v) for v in VARIABLES])


def _values() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [
        torch.randn(11, generator=generator),
        torch.randn(4, generator=generator, dtype=torch.float64),
    ]


def _gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [
        torch.randn(11, generator=generator),
        torch.randn(4, generator=generator, dtype=torch.float64),
    ]


@pytest.fixture
def services() -> Iterator[list[RunningService]]:
    running: list[RunningService] = []
    yield running
    stop_services(running)


@pytest.fixture
def channels() -> Iterator[list[Channel]]:
    opened: list[Channel] = []
    yield opened
    for channel in opened:
        channel.close()


def _shard(
    services: list[RunningService],
    channels: list[Channel],
    rule: UpdateRule,
    discipline: UpdateDiscipline | None = None,
    gradient_dtype: str | None = None,
) -> Channel:
    """A fresh shard holding VARIABLES, and a channel to it (hello said, declaring
    ``gradient_dtype`` when given; variables created)."""
    services.append(
        serve_in_thread(ServiceConfig(shard_index=0, worker_tasks=("worker:0",)), SECRET)
    )
    channel = Channel(services[-1].address, SECRET, "ps:0")
    channels.append(channel)
    hello = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": "worker:0"}
    if gradient_dtype is not None:
        hello["gradient_dtype"] = gradient_dtype
    channel.call("hello", hello, timeout_s=TIMEOUT_S)
    body = {
        "variables": VARIABLES,
        "rule": rule.to_wire(),
        "owns_global_step": True,
        "task": "worker:0",
        "discipline": (discipline or UpdateDiscipline(ema_decay=0.75)).to_wire(),
    }
    channel.call("create", body, [as_buffer(v) for v in _values()], TIMEOUT_S)
    return channel


def _part(gradients: list[torch.Tensor], start: int, stop: int) -> list[memoryview]:
    """The buffers of a bucket of variables [start, stop): each group's slice."""
    return [
        as_buffer(g[lo:hi].contiguous())
        for g, (lo, hi) in zip(gradients, LAYOUT.part_slices(start, stop), strict=True)
    ]


def _push_part(channel: Channel, buffers: list, **body: Any) -> Any:
    return channel.call(
        "push", {"task": "worker:0", "want_values": True, **body}, buffers, TIMEOUT_S
    )


def test_part_slices_are_contiguous_per_group_and_empty_where_a_group_has_none() -> None:
    assert LAYOUT.part_slices(0, 4) == [(0, 11), (0, 4)]
    assert LAYOUT.part_slices(2, 3) == [(0, 0), (0, 4)]  # d only
    assert LAYOUT.part_slices(1, 4) == [(6, 11), (0, 4)]  # b and e: the float32 slice spans them
    assert LAYOUT.part_slices(3, 4) == [(9, 11), (0, 0)]
    assert LAYOUT.part_bytes(1, 3) == [12, 32]


@pytest.mark.parametrize(
    "rule",
    [Adam(lr=0.01, weight_decay=0.1), SGD(lr=0.1, momentum=0.9, nesterov=True), Adagrad(lr=0.1)],
    ids=["adam", "sgd-nesterov", "adagrad"],
)
def test_a_step_pushed_in_buckets_moves_the_shard_as_the_whole_push_bit_for_bit(
    services: list[RunningService], channels: list[Channel], rule: UpdateRule
) -> None:
    whole, parts = _shard(services, channels, rule), _shard(services, channels, rule)
    buckets = [(3, 4), (2, 3), (0, 2)]  # the model's last variables first, as in a backward
    for step in range(3):
        gradients = _gradients(step)
        expected = whole.call(
            "push",
            {"task": "worker:0", "want_values": True, "count_step": True},
            [as_buffer(g) for g in gradients],
            TIMEOUT_S,
        )
        for index, (start, stop) in enumerate(buckets):
            last = index == len(buckets) - 1
            reply = _push_part(
                parts, _part(gradients, start, stop), part=[start, stop], last=last, count_step=last
            )
            slices = LAYOUT.part_slices(start, stop)
            for buffer, full, (lo, hi), group in zip(
                reply.buffers, expected.buffers, slices, LAYOUT.groups, strict=True
            ):  # the reply carries the bucket's new values, those of the whole push's reply
                dtype = torch.float64 if group.dtype == "float64" else torch.float32
                assert bits(from_buffer(buffer, dtype)) == bits(from_buffer(full, dtype)[lo:hi])
        assert reply.body["global_step"] == expected.body["global_step"] == step + 1
    for op_body in ({}, {"moving_average": True}):
        a = whole.call("pull", op_body, timeout_s=TIMEOUT_S).buffers
        b = parts.call("pull", op_body, timeout_s=TIMEOUT_S).buffers
        assert [bytes(x) for x in a] == [bytes(y) for y in b]
    documents = [c.call("save", {"task": "worker:0"}, timeout_s=TIMEOUT_S) for c in (whole, parts)]
    assert bytes(documents[0].buffers[0]) == bytes(documents[1].buffers[0])  # optimizer state too
    stats = [c.call("stats", {}, timeout_s=TIMEOUT_S).body for c in (whole, parts)]
    assert stats[0]["pushes"] == stats[1]["pushes"] == 3  # once per step, not per bucket
    assert stats[1]["buckets"] == 9


def test_bf16_buckets_encoded_with_error_feedback_move_the_shard_as_the_whole_bf16_push(
    services: list[RunningService], channels: list[Channel]
) -> None:
    """Each bucket's float32 slices go as bf16 with their own elements' residuals: the bytes
    sent, the residuals kept and the shard's values equal those of whole bf16 pushes."""
    rule = Adam(lr=0.01)
    whole = _shard(services, channels, rule, gradient_dtype="bf16")
    parts = _shard(services, channels, rule, gradient_dtype="bf16")
    whole_encoder, parts_encoder = ErrorFeedback("bf16"), ErrorFeedback("bf16")
    buckets = [(3, 4), (2, 3), (0, 2)]
    push = {"task": "worker:0", "want_values": True, "gradient_dtype": "bf16"}
    for step in range(4):
        gradients = [g * 10.0 ** (step - 6) for g in _gradients(step)]  # bf16 rounding shows
        sent = whole_encoder.encode(0, LAYOUT.groups, [as_buffer(g.clone()) for g in gradients])
        whole.call("push", {**push, "count_step": True}, sent, TIMEOUT_S)
        for index, (start, stop) in enumerate(buckets):
            last = index == len(buckets) - 1
            slices = LAYOUT.part_slices(start, stop)
            bucket = parts_encoder.encode(
                0, LAYOUT.groups, _part(gradients, start, stop), slices=slices
            )
            for mine, theirs, (lo, hi), group in zip(
                bucket, sent, slices, LAYOUT.groups, strict=True
            ):
                size = 2 if group.dtype == "float32" else 8
                assert bytes(mine) == bytes(memoryview(theirs).cast("B")[lo * size : hi * size])
            _push_part(
                parts, bucket, part=[start, stop], last=last, count_step=last, gradient_dtype="bf16"
            )
        a = whole.call("pull", {}, timeout_s=TIMEOUT_S).buffers
        b = parts.call("pull", {}, timeout_s=TIMEOUT_S).buffers
        assert [bytes(x) for x in a] == [bytes(y) for y in b]
    residual = whole_encoder.residual(0, 0)
    assert residual is not None and residual.abs().max() > 0  # rounding was owed ...
    assert bits(parts_encoder.residual(0, 0)) == bits(residual)  # ... the same by buckets


@pytest.mark.parametrize(
    ("body", "buffers", "message"),
    [
        ({"part": [0, 9], "last": True}, "whole", "not a range of this shard's variables"),
        ({"part": [2, 2], "last": True}, "whole", "not a range"),
        ({"part": [-1, 2], "last": True}, "whole", "not a range"),
        ({"part": [0, "2"], "last": True}, "whole", "two integers"),
        ({"part": [0, True], "last": True}, "whole", "two integers"),
        ({"part": [0, 1, 2], "last": True}, "whole", "two integers"),
        ({"part": [0, 2], "last": True}, "short", "the float32 buffer has 32 bytes"),
        ({"part": [0, 2], "last": True}, "one", "has 1 buffers, the shard has 2 dtype groups"),
        ({"part": [0, 2], "last": False, "count_step": True}, "fit", "'count_step' on a bucket"),
        ({"part": [0, 2], "last": "yes"}, "fit", "must be booleans"),
        ({"part": [0, 2], "last": False, "data": {"epoch": 1}}, "fit", "data position"),
    ],
)
def test_a_malformed_bucket_is_refused_with_a_protocol_error_and_the_shard_serves_on(
    services: list[RunningService],
    channels: list[Channel],
    body: dict,
    buffers: str,
    message: str,
) -> None:
    channel = _shard(services, channels, SGD(lr=0.1))
    gradients = _gradients(0)
    sent = {
        "whole": [as_buffer(g) for g in gradients],
        "short": [as_buffer(gradients[0][:8]), as_buffer(gradients[1][:0])],
        "one": [as_buffer(gradients[0][:9])],
        "fit": _part(gradients, 0, 2),
    }[buffers]
    before = channel.call("pull", {}, timeout_s=TIMEOUT_S).buffers
    with pytest.raises(RemoteProtocolError, match=message):
        _push_part(channel, sent, **body)
    after = channel.call("pull", {}, timeout_s=TIMEOUT_S).buffers
    assert [bytes(b) for b in before] == [bytes(a) for a in after]  # nothing changed
    reply = _push_part(channel, _part(gradients, 0, 2), part=[0, 2], last=True, count_step=True)
    assert reply.body["global_step"] == 1  # still serving, counting once
    assert "error" not in services[-1].result


@pytest.mark.parametrize(
    "discipline",
    [UpdateDiscipline(mode="sync"), UpdateDiscipline(max_staleness=2)],
    ids=["sync", "max-staleness"],
)
def test_modes_that_take_whole_steps_refuse_a_bucket_naming_the_mode(
    services: list[RunningService], channels: list[Channel], discipline: UpdateDiscipline
) -> None:
    channel = _shard(services, channels, SGD(lr=0.1), discipline)
    with pytest.raises(RequestRefused, match="only plain async pushes buckets"):
        _push_part(channel, _part(_gradients(0), 0, 2), part=[0, 2], last=True)
