"""The age bound of asynchronous pushes (tensorfleet.ps.gradient_age): the rule alone, then on
a real ps with real clients. A push computed on values more than ``max_gradient_age``
updates old changes nothing on the shard (values, version, global step), is answered
``dropped`` with the current values, and is counted; a push within the bound, a push with
``"off"``, and a bucket within the bound are applied; a malformed ``based_on`` is refused
before anything changes; every client push names the version of the values it holds."""

from __future__ import annotations

import logging

import pytest
import torch

from tensorfleet.errors import ConfigError, RemoteProtocolError
from tensorfleet.ps.gradient_age import (
    AUTO_MINIMUM,
    AUTO_PER_WORKER,
    LOG_EVERY_S,
    GradientAge,
    age_bin,
    check_setting,
    resolve_limit,
)
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import SGD
from tensorfleet.session.update_modes import UpdateSettings
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.tensors import as_buffer
from tensorfleet.worker.client import ClientTimeouts, ParameterClient

from .service_harness import serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(60)

SECRET = b"gradient-age-unit-test-secret-00000000001"
TIMEOUT_S = 5.0


def test_bins_are_powers_of_two_and_the_auto_limit_grows_with_the_workers() -> None:
    assert [age_bin(a) for a in (0, 1, 2, 3, 4, 7, 8, 300)] == [
        "0",
        "1",
        "2-3",
        "2-3",
        "4-7",
        "4-7",
        "8-15",
        "256-511",
    ]
    assert resolve_limit("auto", 1) == AUTO_MINIMUM
    assert resolve_limit("auto", 10) == AUTO_PER_WORKER * 10
    assert resolve_limit("off", 3) is None
    assert resolve_limit(5, 3) == 5
    for bad in (0, -1, True, 2.5, "never", None):
        with pytest.raises(ConfigError, match="max_gradient_age must be 'auto', 'off' or"):
            check_setting(bad)
    with pytest.raises(ConfigError, match="needs mode 'async'"):
        UpdateDiscipline(mode="sync", max_gradient_age=10)
    with pytest.raises(ConfigError, match="max_gradient_age must be"):
        UpdateSettings(max_gradient_age=0)
    assert UpdateDiscipline.from_wire(UpdateDiscipline(max_gradient_age="off").to_wire()) == (
        UpdateDiscipline(max_gradient_age="off")
    )


def test_the_rule_drops_only_pushes_older_than_the_limit_and_counts_every_push(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ages = GradientAge(limit=4, shard="ps:0")
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps"):
        assert ages.admit(10, 10, "worker:0")  # age 0
        assert ages.admit(10, 6, "worker:1")  # age 4: at the limit, applied
        assert not ages.admit(10, 5, "worker:1")  # age 5: dropped
        assert ages.admit(10, None, "worker:2")  # no based_on: applied, unknown
        assert ages.admit(3, 10, "worker:2")  # values newer than the shard's: applied, age 0
    assert ages.stats() == {
        "limit": 4,
        "bins": {"0": 2, "4-7": 2},
        "unknown": 1,
        "oldest_applied": 4,
        "dropped": 1,
        "dropped_by_worker": {"worker:1": 1},
    }
    assert [r.getMessage() for r in caplog.records] == [
        "ps:0: dropped worker:1's push: its gradient was computed on values 5 updates old "
        "(version 5, the shard is at 10), over max_gradient_age=4; it is answered with the "
        "current values (the worker stood still while the others trained: stopped, paused or "
        "cut off)"
    ]
    assert ages.summary() == (
        "pushes up to 4 updates old applied, 1 dropped as older (worker:1 1; max_gradient_age=4)"
    )
    off = GradientAge(limit=None)
    assert off.admit(1000, 0, "worker:0") and off.dropped == 0
    assert off.summary() == (
        "pushes up to 1000 updates old applied, none dropped (max_gradient_age=off)"
    )


def test_the_drops_of_one_worker_are_logged_at_most_once_per_ten_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    ages = GradientAge(limit=1, shard="ps:0", clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps"):
        for _ in range(3):  # one line, two not logged
            assert not ages.admit(100, 0, "worker:1")
        assert not ages.admit(100, 0, "worker:2")  # another worker: its own line
        now[0] = LOG_EVERY_S
        assert not ages.admit(100, 0, "worker:1")  # says how many it did not log
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split("'s push")[0] for line in lines] == [
        "ps:0: dropped worker:1",
        "ps:0: dropped worker:2",
        "ps:0: dropped worker:1",
    ]
    assert lines[2].endswith("; 2 more of its pushes dropped since the last such line")
    assert "more of its pushes" not in lines[0] + lines[1]
    assert ages.dropped == 5 and ages.dropped_by_worker == {"worker:1": 4, "worker:2": 1}


def _service_and_clients(max_gradient_age: int | str):  # type: ignore[no-untyped-def]
    running = serve_in_thread(
        ServiceConfig(0, ("worker:0", "worker:1"), idle_timeout_s=60.0, end_grace_s=60.0),
        SECRET,
    )
    timeouts = ClientTimeouts(connect_s=TIMEOUT_S, step_s=TIMEOUT_S, recover_s=TIMEOUT_S)
    clients = [ParameterClient([running.address], SECRET, f"worker:{i}", timeouts) for i in (0, 1)]
    weights = [torch.nn.Parameter(torch.zeros(5)) for _ in clients]
    plan = plan_placement([VariableSpec("w", (5,), "float32", 4)], 1)
    discipline = UpdateDiscipline(max_gradient_age=max_gradient_age)
    for i, (client, weight) in enumerate(zip(clients, weights, strict=True)):
        client.connect()
        client.register([("w", weight)], plan, SGD(lr=1.0), is_chief=i == 0, discipline=discipline)
        client.pull()  # as a session's start does
    return running, clients, weights


def test_a_push_on_values_too_old_changes_nothing_and_brings_the_current_values() -> None:
    running, clients, weights = _service_and_clients(max_gradient_age=2)
    fast, slow = clients
    try:
        # the slow worker holds the values of version 0 (its start's pull)
        for _ in range(3):  # the fast one trains on: version 3
            weights[0].grad = torch.ones(5)
            assert not fast.push_pull().dropped
        current = weights[0].detach().clone()
        assert torch.equal(current, torch.full((5,), -3.0))
        weights[1].grad = torch.full((5,), 100.0)
        progress = slow.push_pull()  # computed on version 0: 3 updates old, over 2
        assert progress.dropped and not progress.made_step
        assert progress.global_step == 3, "a dropped push is not a step"
        assert torch.equal(weights[1].detach(), current), "answered with the current values"
        fast.pull()
        assert torch.equal(weights[0].detach(), current), "the dropped push was not applied"
        weights[1].grad = torch.ones(5)  # on the values just received: age 0
        progress = slow.push_pull()
        assert not progress.dropped and progress.made_step and progress.global_step == 4
        assert torch.equal(weights[1].detach(), torch.full((5,), -4.0))
        ages = fast.stats()[0]["gradient_age"]
        assert ages["limit"] == 2 and ages["dropped"] == 1
        assert ages["dropped_by_worker"] == {"worker:1": 1}
        assert sum(ages["bins"].values()) == 5 and ages["bins"]["2-3"] == 1
        assert ages["oldest_applied"] <= 2 and ages["unknown"] == 0
    finally:
        for client in clients:
            client.close()
        stop_services([running])


def test_off_applies_every_push_however_old() -> None:
    running, clients, weights = _service_and_clients(max_gradient_age="off")
    fast, slow = clients
    try:
        for _ in range(3):
            weights[0].grad = torch.ones(5)
            fast.push_pull()
        weights[1].grad = torch.ones(5)
        progress = slow.push_pull()
        assert progress.made_step and not progress.dropped and progress.global_step == 4
        ages = fast.stats()[0]["gradient_age"]
        assert ages["limit"] is None and ages["dropped"] == 0 and ages["oldest_applied"] == 3
    finally:
        for client in clients:
            client.close()
        stop_services([running])


def test_a_stale_bucket_is_dropped_a_fresh_one_applied_and_a_bad_based_on_refused() -> None:
    running, clients, weights = _service_and_clients(max_gradient_age=2)
    raw = Channel(running.address, SECRET, "ps:0")
    try:
        for _ in range(3):
            weights[0].grad = torch.ones(5)
            clients[0].push_pull()
        hello = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": "worker:1"}
        raw.call("hello", {**hello, "instance": clients[1].instance}, timeout_s=TIMEOUT_S)
        body = {"task": "worker:1", "want_values": True, "part": [0, 1], "last": True}
        gradient = [as_buffer(torch.ones(5))]
        for bad in (-1, "3", True, 2.5):
            with pytest.raises(RemoteProtocolError, match="'based_on' must be"):
                raw.call("push", {**body, "based_on": bad}, gradient, TIMEOUT_S)
        stale = raw.call("push", {**body, "based_on": 0}, gradient, TIMEOUT_S)
        assert stale.body["dropped"] is True and stale.body["made_step"] is False
        assert stale.body["version"] == 3
        fresh = raw.call("push", {**body, "based_on": 3}, gradient, TIMEOUT_S)
        assert fresh.body["dropped"] is False and fresh.body["version"] == 4
        clients[0].pull()
        assert torch.equal(weights[0].detach(), torch.full((5,), -4.0))
        ages = clients[0].stats()[0]["gradient_age"]
        assert ages["dropped"] == 1 and ages["bins"]["2-3"] == 1
    finally:
        raw.close()
        for client in clients:
            client.close()
        stop_services([running])
