"""A real :class:`ParameterService` created with an update discipline (sync, sync with backup
workers, async with bounded staleness, clipping, moving average), served in a background
thread and driven by raw :class:`Channel` s, one per worker.

Tests synchronize on replies: requests on one channel are handled in order, so the reply to
a ``stats`` sent after a push proves the push was handled (and, when the stats show no
update, that it is being held).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tensorfleet.errors import RemoteError
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.sync_step import _clip_by_global_norm
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import SGD
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.channel import Channel, Reply
from tensorfleet.wire.tensors import as_buffer

from .service_harness import RunningService, assert_values, bits, serve_in_thread, stop_services

SECRET = b"sync-service-unit-test-secret-0000001"
WORKERS = ("worker:0", "worker:1", "worker:2")
TIMEOUT_S = 5.0
"""Upper bound of every wait that is expected to succeed (they take milliseconds)."""
LR = 0.25

#: Two dtype groups, values and gradients dyadic so that SGD and the moving average are exact.
VARIABLES = [
    {"name": "w", "shape": [2, 2], "dtype": "float32"},
    {"name": "b", "shape": [2], "dtype": "float32"},
    {"name": "d", "shape": [3], "dtype": "float64"},
]
INITIAL = [
    torch.tensor([1.0, -2.0, 0.5, 4.0, 0.25, -8.0]),
    torch.tensor([2.0, -0.5, 16.0], dtype=torch.float64),
]
#: One gradient per worker; the first float32 element makes the float32 sum order-sensitive:
#: (1e8 + -1e8) + 1 == 1 but (1 + 1e8) + -1e8 == 0.
GRADIENTS = {
    "worker:0": [
        torch.tensor([1e8, 0.5, -1.0, 2.0, 0.25, 4.0]),
        torch.tensor([1.0, 2.0, -0.5], dtype=torch.float64),
    ],
    "worker:1": [
        torch.tensor([-1e8, 1.5, 3.0, -2.0, 0.75, 8.0]),
        torch.tensor([3.0, -2.0, 0.5], dtype=torch.float64),
    ],
    "worker:2": [
        torch.tensor([1.0, -4.0, 1.0, 6.0, 0.5, 0.0]),
        torch.tensor([-1.0, 0.25, 2.0], dtype=torch.float64),
    ],
}


def _mean(tasks: list[str]) -> list[torch.Tensor]:
    """The mean of these workers' gradients, summed in worker order as the ps must."""
    ordered = [t for t in WORKERS if t in tasks]
    mean = [g.clone() for g in GRADIENTS[ordered[0]]]
    for task in ordered[1:]:
        for total, gradient in zip(mean, GRADIENTS[task], strict=True):
            total.add_(gradient)
    return [total.div_(len(ordered)) for total in mean]


def _sgd(values: list[torch.Tensor], *steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """What torch.optim.SGD(lr=LR) makes of ``values`` after these gradients."""
    params = [torch.nn.Parameter(v.clone()) for v in values]
    optimizer = torch.optim.SGD(params, lr=LR)
    for gradients in steps:
        for param, grad in zip(params, gradients, strict=True):
            param.grad = grad.clone()
        optimizer.step()
    return [p.detach() for p in params]


# -- a service in a thread, and worker channels ------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[Callable[..., RunningService]]:
    """Start a service (``worker_tasks`` = ``workers``); connect worker channels with
    :func:`worker`. Everything is stopped, checked for a crash and closed at teardown."""
    services: list[RunningService] = []
    channels: list[Channel] = []

    def start(
        workers: tuple[str, ...] = WORKERS[:2], liveness_timeout_s: float = 60.0
    ) -> RunningService:
        config = ServiceConfig(
            0,
            workers,
            idle_timeout_s=60.0,
            end_grace_s=60.0,
            liveness_timeout_s=liveness_timeout_s,
        )
        services.append(serve_in_thread(config, SECRET))
        return services[-1]

    start.channels = channels  # type: ignore[attr-defined]
    start.services = services  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        stop_services(services, channels)


def _worker(cluster: Callable[..., RunningService], ps: RunningService, task: str) -> Channel:
    channel = Channel(ps.address, SECRET, "ps:0")
    cluster.channels.append(channel)  # type: ignore[attr-defined]
    body = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": task}
    channel.call("hello", body, timeout_s=TIMEOUT_S)
    return channel


def _create(channel: Channel, discipline: UpdateDiscipline, values=INITIAL) -> dict:
    body = {
        "variables": VARIABLES,
        "rule": SGD(lr=LR).to_wire(),
        "owns_global_step": True,
        "discipline": discipline.to_wire(),
    }
    return channel.call("create", body, [as_buffer(v) for v in values], TIMEOUT_S).body


def _send_push(
    channel: Channel,
    task: str | None,
    step: object = None,
    gradients: list[torch.Tensor] | None = None,
    timeout_s: float = TIMEOUT_S,
) -> int:
    body: dict[str, Any] = {"count_step": True, "want_values": True, "step": step}
    if task is not None:
        body["task"] = task
    gradients = GRADIENTS.get(task, GRADIENTS["worker:0"]) if gradients is None else gradients
    return channel.send("push", body, [as_buffer(g) for g in gradients], timeout_s)


def _push(channel: Channel, task: str | None, step: object = None, **kwargs: Any) -> Reply:
    return channel.wait(_send_push(channel, task, step, **kwargs), TIMEOUT_S)


def _stats(channel: Channel) -> dict:
    return channel.call("stats", {}, timeout_s=TIMEOUT_S).body


def _sync_cluster(
    cluster: Callable[..., RunningService],
    workers: tuple[str, ...],
    liveness_timeout_s: float = 60.0,
    **discipline: Any,
) -> dict[str, Channel]:
    ps = cluster(workers, liveness_timeout_s)
    channels = {task: _worker(cluster, ps, task) for task in workers}
    created = _create(channels[workers[0]], UpdateDiscipline(mode="sync", **discipline))
    assert created == {"created": True, "global_step": 0, "data": None}
    return channels


# -- sync -----------------------------------------------------------------------------------------


def test_a_sync_step_is_applied_once_all_k_pushes_are_in_whatever_their_order(
    cluster: Callable[..., RunningService],
) -> None:
    channels = _sync_cluster(cluster, WORKERS)
    arrival = ["worker:2", "worker:0", "worker:1"]
    pending = {}
    for count, task in enumerate(arrival[:2], start=1):
        pending[task] = _send_push(channels[task], task, step=0)
        stats = _stats(channels[task])  # answered after the push was handled: it is held
        assert (stats["version"], stats["global_step"], stats["pushes"]) == (0, 0, 0), count
        assert stats["refused"] == 0
    pending["worker:1"] = _send_push(channels["worker:1"], "worker:1", step=0)

    expected = _sgd(INITIAL, _mean(list(WORKERS)))
    made = {}
    for task, request_id in pending.items():
        reply = channels[task].wait(request_id, TIMEOUT_S)
        assert {k: reply.body[k] for k in ("global_step", "version", "dropped", "stop")} == {
            "global_step": 1,
            "version": 1,
            "dropped": False,
            "stop": False,
        }
        assert_values(reply.buffers, expected)
        made[task] = reply.body["made_step"]
    assert made == {"worker:2": False, "worker:0": False, "worker:1": True}
    stats = _stats(channels["worker:0"])
    assert (stats["global_step"], stats["pushes"], stats["dropped"], stats["mode"]) == (
        1,
        3,
        {},
        "sync",
    )


def test_summing_in_arrival_order_would_have_given_other_bits() -> None:
    """Guard for the test above: its arrival order really changes the float32 sum."""
    arrival = [GRADIENTS[t][0] for t in ("worker:2", "worker:0", "worker:1")]
    in_arrival_order = (arrival[0] + arrival[1] + arrival[2]) / 3
    assert bits(in_arrival_order) != bits(_mean(list(WORKERS))[0])


def test_a_push_for_an_older_step_is_dropped_at_once_and_counted(
    cluster: Callable[..., RunningService], caplog: pytest.LogCaptureFixture
) -> None:
    channels = _sync_cluster(cluster, WORKERS[:2])
    first = _send_push(channels["worker:0"], "worker:0", step=0)
    _push(channels["worker:1"], "worker:1", step=0)
    channels["worker:0"].wait(first, TIMEOUT_S)
    after_step = _sgd(INITIAL, _mean(["worker:0", "worker:1"]))

    stale = _push(channels["worker:0"], "worker:0", step=0)

    assert stale.body == {
        "global_step": 1,
        "version": 1,
        "stop": False,
        "made_step": False,
        "dropped": True,
    }
    assert_values(stale.buffers, after_step)  # the current values, unchanged
    stats = _stats(channels["worker:1"])
    assert stats["dropped"] == {"worker:0": 1}
    assert (stats["version"], stats["pushes"], stats["refused"]) == (1, 2, 0)
    caplog.set_level(logging.INFO, logger="tensorfleet.ps")
    channels["worker:0"].call("end", {"task": "worker:0"}, timeout_s=TIMEOUT_S)
    assert "1 gradient dropped as too late for a step (worker:0 1)" in caplog.text


def test_with_backup_workers_the_first_k_make_the_step_and_the_late_one_is_dropped(
    cluster: Callable[..., RunningService],
) -> None:
    channels = _sync_cluster(cluster, WORKERS, replicas_to_aggregate=2)
    first = _send_push(channels["worker:2"], "worker:2", step=0)
    assert _stats(channels["worker:2"])["version"] == 0
    second = _push(channels["worker:0"], "worker:0", step=0)
    first_reply = channels["worker:2"].wait(first, TIMEOUT_S)
    expected = _sgd(INITIAL, _mean(["worker:0", "worker:2"]))
    assert (first_reply.body["made_step"], second.body["made_step"]) == (False, True)
    assert_values(first_reply.buffers, expected)
    assert_values(second.buffers, expected)

    late = _push(channels["worker:1"], "worker:1", step=0)

    assert (late.body["dropped"], late.body["made_step"], late.body["version"]) == (True, False, 1)
    assert_values(late.buffers, expected)
    # The late worker then contributes to the current step with the values it got.
    held = _send_push(channels["worker:1"], "worker:1", step=1)
    assert _stats(channels["worker:1"])["version"] == 1
    reply = _push(channels["worker:2"], "worker:2", step=1)
    assert channels["worker:1"].wait(held, TIMEOUT_S).body["made_step"] is False
    assert reply.body["global_step"] == 2
    assert_values(reply.buffers, _sgd(expected, _mean(["worker:1", "worker:2"])))
    assert _stats(channels["worker:0"])["dropped"] == {"worker:1": 1}


@pytest.mark.parametrize(
    ("task", "step", "error"),
    [
        ("worker:0", 1, "ProtocolError: worker:0 pushed gradients for step 1, but this shard is"),
        ("worker:0", None, "ProtocolError: a sync push needs the integer 'step'"),
        (
            "worker:0",
            True,
            "ProtocolError: a sync push needs the integer 'step' its gradients belong to, got True",
        ),
        (
            "worker:0",
            "0",
            "ProtocolError: a sync push needs the integer 'step' its gradients belong to, got '0'",
        ),
        (
            None,
            0,
            "ProtocolError: push from unknown task None; workers are ['worker:0', 'worker:1']",
        ),
        ("worker:7", 0, "ProtocolError: push from unknown task 'worker:7'"),
        ("ps:0", 0, "ProtocolError: push from unknown task 'ps:0'"),
    ],
)
def test_sync_pushes_for_a_future_step_or_an_unknown_task_are_refused(
    cluster: Callable[..., RunningService], task: str | None, step: object, error: str
) -> None:
    channels = _sync_cluster(cluster, WORKERS[:2])
    with pytest.raises(RemoteError) as excinfo:
        _push(channels["worker:0"], task, step=step)
    assert "refused 'push': " + error in str(excinfo.value)
    stats = _stats(channels["worker:0"])
    assert (stats["refused"], stats["version"], stats["global_step"]) == (1, 0, 0)
    # The refused push counts for nothing: worker:1 alone does not make the step.
    held = _send_push(channels["worker:1"], "worker:1", step=0)
    assert _stats(channels["worker:1"])["version"] == 0
    reply = _push(channels["worker:0"], "worker:0", step=0)
    assert (reply.body["global_step"], reply.body["made_step"]) == (1, True)
    assert channels["worker:1"].wait(held, TIMEOUT_S).body["made_step"] is False


def test_replicas_to_aggregate_above_the_number_of_workers_is_refused_at_create(
    cluster: Callable[..., RunningService],
) -> None:
    ps = cluster(WORKERS[:2])
    channel = _worker(cluster, ps, "worker:0")
    with pytest.raises(RemoteError, match=r"between 1 and the number of workers \(2\), got 3"):
        _create(channel, UpdateDiscipline(mode="sync", replicas_to_aggregate=3))
    assert (
        channel.call(
            "hello",
            {"protocol": wire.PROTOCOL_VERSION, "version": __version__},
            timeout_s=TIMEOUT_S,
        ).body["initialized"]
        is False
    )


def test_a_held_sync_push_past_its_deadline_is_refused_naming_the_missing_workers(
    cluster: Callable[..., RunningService],
) -> None:
    channels = _sync_cluster(cluster, WORKERS)
    _send_push(channels["worker:1"], "worker:1", step=0)  # waits for the others, long deadline
    assert _stats(channels["worker:1"])["version"] == 0
    request = _send_push(channels["worker:0"], "worker:0", step=0, timeout_s=0.3)

    with pytest.raises(RemoteError) as excinfo:
        channels["worker:0"].wait(request, TIMEOUT_S)

    text = str(excinfo.value)
    assert (
        "refused 'push': DeadlineExceeded: step 0 still waits for gradients from worker:2 " in text
    )
    assert "(3 of 3 needed): are they still running?" in text
    assert "worker:0" not in text.split("DeadlineExceeded")[1]  # it had contributed
    assert _stats(channels["worker:2"])["version"] == 0


def test_a_sync_step_completes_after_a_deadline_refusal_when_the_others_come(
    cluster: Callable[..., RunningService],
) -> None:
    channels = _sync_cluster(cluster, WORKERS[:2])
    request = _send_push(channels["worker:0"], "worker:0", step=0, timeout_s=0.3)
    with pytest.raises(RemoteError, match="still waits for gradients from worker:1 "):
        channels["worker:0"].wait(request, TIMEOUT_S)
    # The withdrawn gradient does not count: worker:1 alone does not make the step.
    held = _send_push(channels["worker:1"], "worker:1", step=0)
    assert _stats(channels["worker:1"])["version"] == 0
    retry = _push(channels["worker:0"], "worker:0", step=0)
    assert channels["worker:1"].wait(held, TIMEOUT_S).body["made_step"] is False
    assert (retry.body["made_step"], retry.body["global_step"]) == (True, 1)
    assert_values(retry.buffers, _sgd(INITIAL, _mean(["worker:0", "worker:1"])))


def test_a_worker_saying_done_lowers_the_needed_count(
    cluster: Callable[..., RunningService],
) -> None:
    channels = _sync_cluster(cluster, WORKERS)
    held = {}
    for task in ("worker:0", "worker:1"):
        held[task] = _send_push(channels[task], task, step=0)
        assert _stats(channels[task])["version"] == 0  # handled, and held

    channels["worker:2"].call("done", {"task": "worker:2"}, timeout_s=TIMEOUT_S)

    expected = _sgd(INITIAL, _mean(["worker:0", "worker:1"]))
    replies = {t: channels[t].wait(r, TIMEOUT_S) for t, r in held.items()}
    for reply in replies.values():
        assert (reply.body["global_step"], reply.body["dropped"]) == (1, False)
        assert_values(reply.buffers, expected)
    # Exactly one worker made the step: the last contributor.
    assert {t: r.body["made_step"] for t, r in replies.items()} == {
        "worker:0": False,
        "worker:1": True,
    }
    # From now on two pushes make a step.
    other = _send_push(channels["worker:1"], "worker:1", step=1)
    assert _stats(channels["worker:1"])["version"] == 1
    reply = _push(channels["worker:0"], "worker:0", step=1)
    assert (reply.body["global_step"], reply.body["made_step"]) == (2, True)
    assert channels["worker:1"].wait(other, TIMEOUT_S).body["made_step"] is False


@pytest.mark.parametrize("clip_norm", [0.5, 1e9])
def test_sync_clips_the_mean_like_clip_grad_norm(
    cluster: Callable[..., RunningService], clip_norm: float
) -> None:
    """One float32 variable, so that the global norm is computed over the same tensors."""
    ps = cluster(WORKERS[:2])
    channels = {t: _worker(cluster, ps, t) for t in WORKERS[:2]}
    value = torch.tensor([1.0, -2.0, 3.0, 0.5])
    gradients = {
        "worker:0": torch.tensor([3.0, 1.0, -2.0, 0.7]),
        "worker:1": torch.tensor([1.0, -0.3, 4.0, 0.1]),
    }
    body = {
        "variables": [{"name": "v", "shape": [4], "dtype": "float32"}],
        "rule": SGD(lr=LR).to_wire(),
        "owns_global_step": True,
        "discipline": UpdateDiscipline(mode="sync", clip_norm=clip_norm).to_wire(),
    }
    channels["worker:0"].call("create", body, [as_buffer(value)], TIMEOUT_S)
    first = _send_push(channels["worker:0"], "worker:0", 0, [gradients["worker:0"]])
    reply = _push(channels["worker:1"], "worker:1", 0, gradients=[gradients["worker:1"]])
    channels["worker:0"].wait(first, TIMEOUT_S)

    param = torch.nn.Parameter(value.clone())
    param.grad = gradients["worker:0"].clone().add_(gradients["worker:1"]).div_(2)
    norm = torch.nn.utils.clip_grad_norm_([param], clip_norm)
    assert (norm.item() > clip_norm) == (clip_norm == 0.5)  # the case clips, or does not
    torch.optim.SGD([param], lr=LR).step()
    assert_values(reply.buffers, [param.detach()])


def test_clip_by_global_norm_matches_clip_grad_norm_across_tensors_and_dtypes() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(17, generator=generator) * 3,
        torch.randn(5, generator=generator, dtype=torch.float64),
        torch.randn(2, 3, generator=generator),
    ]
    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    for param, tensor in zip(params, tensors, strict=True):
        param.grad = tensor.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.5)
    clipped = [t.clone() for t in tensors]
    _clip_by_global_norm(clipped, 1.5)
    for ours, theirs in zip(clipped, params, strict=True):
        assert ours.dtype == theirs.grad.dtype
        torch.testing.assert_close(ours, theirs.grad, rtol=1e-6, atol=0)
    total = torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in clipped]))
    assert total.item() == pytest.approx(1.5, rel=1e-5)


# -- async with bounded staleness ----------------------------------------------------------------


def _async_cluster(cluster: Callable[..., RunningService], **discipline: Any) -> dict[str, Channel]:
    ps = cluster(WORKERS[:2])
    channels = {task: _worker(cluster, ps, task) for task in WORKERS[:2]}
    _create(channels["worker:0"], UpdateDiscipline(mode="async", **discipline))
    return channels


def test_a_worker_too_far_ahead_is_held_until_the_slow_one_pushes(
    cluster: Callable[..., RunningService],
) -> None:
    channels = _async_cluster(cluster, max_staleness=1)
    fast, slow = channels["worker:0"], channels["worker:1"]
    # Both are live (worker:1 joins at worker:0's clock, 1, and its push takes it to 2);
    # then the fast one runs ahead: clocks 1 -> 2 -> 3 -> 4 (1 ahead is allowed), not 5.
    assert _push(fast, "worker:0").body["version"] == 1
    assert _push(slow, "worker:1").body["version"] == 2
    for version in (3, 4, 5):
        assert _push(fast, "worker:0").body["version"] == version
    held = _send_push(fast, "worker:0")
    stats = _stats(fast)
    assert (stats["version"], stats["pushes"], stats["max_staleness_seen"]) == (5, 5, 1)

    slow_reply = _push(slow, "worker:1")
    released = fast.wait(held, TIMEOUT_S)

    assert (slow_reply.body["version"], released.body["version"]) == (6, 7)
    assert released.body["made_step"] is True
    order = ["worker:0", "worker:1", "worker:0", "worker:0", "worker:0", "worker:1", "worker:0"]
    assert_values(released.buffers, _sgd(INITIAL, *[GRADIENTS[t] for t in order]))
    stats = _stats(slow)
    assert stats["max_staleness_seen"] == 1
    assert stats["dropped"] == {} and stats["mode"] == "async"


def test_a_held_async_push_is_released_when_the_slow_worker_is_done(
    cluster: Callable[..., RunningService],
) -> None:
    channels = _async_cluster(cluster, max_staleness=0)
    fast, slow = channels["worker:0"], channels["worker:1"]
    for channel, task in [(fast, "worker:0"), (slow, "worker:1"), (fast, "worker:0")]:
        _push(channel, task)
    assert _push(fast, "worker:0").body["version"] == 4  # clocks 3 and 2: now held
    held = _send_push(fast, "worker:0")
    assert _stats(fast)["version"] == 4
    slow.call("done", {"task": "worker:1"}, timeout_s=TIMEOUT_S)
    assert fast.wait(held, TIMEOUT_S).body["version"] == 5
    assert _stats(fast)["max_staleness_seen"] == 0


def test_a_worker_done_while_its_own_push_is_held_does_not_block_the_others(
    cluster: Callable[..., RunningService],
) -> None:
    channels = _async_cluster(cluster, max_staleness=0)
    fast, slow = channels["worker:0"], channels["worker:1"]
    for channel, task in [(fast, "worker:0"), (slow, "worker:1"), (fast, "worker:0")]:
        _push(channel, task)
    assert _push(fast, "worker:0").body["version"] == 4  # clocks 3 and 2: the next is held
    held = _send_push(fast, "worker:0")
    fast.call("done", {"task": "worker:0"}, timeout_s=TIMEOUT_S)  # e.g. a restarted worker:0
    with pytest.raises(RemoteError, match="worker:0 said it is done; its held push is dropped"):
        fast.wait(held, TIMEOUT_S)
    # worker:0 left the gate for good: worker:1 is never held back by it again.
    for version in (5, 6, 7, 8):
        assert _push(slow, "worker:1").body["version"] == version


def test_a_held_async_push_past_its_deadline_is_refused_naming_the_slowest(
    cluster: Callable[..., RunningService],
) -> None:
    channels = _async_cluster(cluster, max_staleness=0)
    fast, slow = channels["worker:0"], channels["worker:1"]
    for channel, task in [(fast, "worker:0"), (slow, "worker:1"), (fast, "worker:0")]:
        _push(channel, task)
    assert _push(fast, "worker:0").body["version"] == 4
    held = _send_push(fast, "worker:0", timeout_s=0.3)
    with pytest.raises(RemoteError) as excinfo:
        fast.wait(held, TIMEOUT_S)
    assert (
        "DeadlineExceeded: worker:0 is 1 steps ahead of the slowest live worker(s) worker:1 "
        "(max_staleness=0)" in str(excinfo.value)
    )
    # It was not applied, and the gate is not stuck.
    assert _stats(fast)["version"] == 4
    assert _push(slow, "worker:1").body["version"] == 5


def test_async_pushes_with_a_gate_need_a_known_task(cluster: Callable[..., RunningService]) -> None:
    channels = _async_cluster(cluster, max_staleness=2)
    with pytest.raises(RemoteError, match="push from unknown task None"):
        _push(channels["worker:0"], None)
    assert _stats(channels["worker:0"])["refused"] == 1


# -- moving average -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_pulling_the_moving_average_gives_the_hand_computed_average(
    cluster: Callable[..., RunningService], mode: str
) -> None:
    decay = 0.75
    ps = cluster(WORKERS[:1])
    channel = _worker(cluster, ps, "worker:0")
    _create(channel, UpdateDiscipline(mode=mode, ema_decay=decay))
    steps = [GRADIENTS["worker:2"], [g * -2 for g in GRADIENTS["worker:2"]]]
    values, average = INITIAL, [v.clone() for v in INITIAL]
    for step, gradients in enumerate(steps):
        _push(channel, "worker:0", step=step, gradients=gradients)
        values = _sgd(values, gradients)
        average = [decay * a + (1 - decay) * v for a, v in zip(average, values, strict=True)]

    reply = channel.call("pull", {"moving_average": True}, timeout_s=TIMEOUT_S)

    assert reply.body == {"global_step": 2, "version": 2, "stop": False}
    assert_values(reply.buffers, average)
    assert not all(torch.equal(a, v) for a, v in zip(average, values, strict=True))
    assert_values(channel.call("pull", {}, timeout_s=TIMEOUT_S).buffers, values)


def test_pulling_a_moving_average_that_is_not_kept_is_refused(
    cluster: Callable[..., RunningService],
) -> None:
    ps = cluster(WORKERS[:1])
    channel = _worker(cluster, ps, "worker:0")
    _create(channel, UpdateDiscipline())
    with pytest.raises(RemoteError, match=r"RequestRefused: this shard keeps no moving average"):
        channel.call("pull", {"moving_average": True}, timeout_s=TIMEOUT_S)


# -- liveness: lost workers, identities ------------------------------------------------------------

LIVENESS_S = 0.5


@contextmanager
def _heartbeats(ps: RunningService, tasks: tuple[str, ...]) -> Iterator[None]:
    """Keep ``tasks`` alive at the service (what a real client's heartbeat thread does)."""
    stop = threading.Event()

    def beat() -> None:
        channel = Channel(ps.address, SECRET, "ps:0")
        try:
            hello = {"protocol": wire.PROTOCOL_VERSION, "version": __version__}
            channel.call("hello", {**hello, "task": tasks[0]}, timeout_s=TIMEOUT_S)
            while not stop.is_set():
                for task in tasks:
                    channel.call("heartbeat", {"task": task}, timeout_s=TIMEOUT_S)
                stop.wait(LIVENESS_S / 5)
        finally:
            channel.close()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(TIMEOUT_S)


def test_a_lost_worker_no_longer_holds_back_a_sync_step_when_shrinking(
    cluster: Callable[..., RunningService],
) -> None:
    """worker:2 said hello (so it is known) and then fell silent: after the liveness timeout
    the step goes on with the mean of the live workers' gradients."""
    channels = _sync_cluster(cluster, WORKERS, LIVENESS_S, lost_worker="shrink")
    with _heartbeats(cluster.services[-1], ("worker:0", "worker:1")):  # type: ignore[attr-defined]
        held = _send_push(channels["worker:0"], "worker:0", 0, timeout_s=10 * LIVENESS_S)
        reply = _push(channels["worker:1"], "worker:1", 0, timeout_s=10 * LIVENESS_S)
        assert reply.body["global_step"] == 1
        channels["worker:0"].wait(held, TIMEOUT_S)
        assert_values(reply.buffers, _sgd(INITIAL, _mean(["worker:0", "worker:1"])))
        assert _stats(channels["worker:0"])["lost_workers"] == ["worker:2"]


def test_a_lost_worker_fails_the_sync_step_by_name_when_told_to(
    cluster: Callable[..., RunningService],
) -> None:
    channels = _sync_cluster(cluster, WORKERS, LIVENESS_S, lost_worker="fail")
    with _heartbeats(cluster.services[-1], ("worker:0", "worker:1")):  # type: ignore[attr-defined]
        with pytest.raises(
            RemoteError, match=r"WorkerLost: step 0 needs gradients from worker:2, not heard"
        ):
            _push(channels["worker:0"], "worker:0", 0, timeout_s=10 * LIVENESS_S)
        assert _stats(channels["worker:1"])["pushes"] == 0


def test_a_second_process_cannot_take_the_identity_of_a_live_worker(
    cluster: Callable[..., RunningService],
) -> None:
    """No second chief by accident: while worker:0 is heard from, a hello claiming worker:0
    from another process is refused; once it has been silent for the liveness timeout, its
    restarted copy is let in."""
    ps = cluster(WORKERS[:2], LIVENESS_S)
    hello = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": "worker:0"}
    first, second = Channel(ps.address, SECRET, "ps:0"), Channel(ps.address, SECRET, "ps:0")
    cluster.channels.extend([first, second])  # type: ignore[attr-defined]
    first.call("hello", {**hello, "instance": "first-process"}, timeout_s=TIMEOUT_S)
    with pytest.raises(RemoteError, match="worker:0 is already running in another process"):
        second.call("hello", {**hello, "instance": "second-process"}, timeout_s=TIMEOUT_S)
    first.call("hello", {**hello, "instance": "first-process"}, timeout_s=TIMEOUT_S)  # itself: fine
    done = threading.Event()
    done.wait(3 * LIVENESS_S)  # the first process falls silent (a dead chief sends nothing)
    second.call("hello", {**hello, "instance": "second-process"}, timeout_s=TIMEOUT_S)
