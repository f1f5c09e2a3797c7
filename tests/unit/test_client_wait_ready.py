"""A worker waiting for the chief to create the variables (``wait_ready``) says what ended the
wait: the deadline, or a ps that went away before it. Real parameter services in threads
(``service_harness``), one non-chief :class:`ParameterClient` in the test."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tensorfleet.errors import ConnectionLost, DeadlineExceeded
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.update_rules import SGD
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.timeouts import ClientTimeouts

from .service_harness import RunningService, serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(60)

SECRET = b"client-wait-ready-unit-test-secret-00000"
CONFIG = ServiceConfig(shard_index=0, worker_tasks=("worker:0", "worker:1"))


def _model() -> list[tuple[str, torch.nn.Parameter]]:
    return [("w", torch.nn.Parameter(torch.ones(3, 2)))]


def _register_as_worker_1(service: RunningService, initialize_s: float) -> None:
    """Connect as worker:1 and wait for the (absent) chief to create the variables."""
    model = _model()
    plan = plan_placement([VariableSpec(n, tuple(p.shape), "float32", 4) for n, p in model], 1)
    timeouts = ClientTimeouts(connect_s=10.0, initialize_s=initialize_s, heartbeat_s=0.25)
    client = ParameterClient([service.address], SECRET, "worker:1", timeouts)
    try:
        client.connect()
        client.register(model, plan, SGD(lr=0.5), is_chief=False)
    finally:
        client.close()


def _signal_waits(service: RunningService) -> threading.Event:
    """An event set once the service holds a ``wait_ready`` (the real handler runs)."""
    held = threading.Event()
    handler = service.service._handlers["wait_ready"]

    def wait_ready(request: Any) -> None:
        handler(request)
        held.set()

    service.service._handlers["wait_ready"] = wait_ready
    return held


def test_a_ps_going_away_ends_the_wait_with_what_happened_not_the_deadline() -> None:
    service = serve_in_thread(CONFIG, SECRET)
    held = _signal_waits(service)
    stopped = threading.Event()

    def stop_once_held() -> None:
        if held.wait(30.0):
            stop_services([service])
            stopped.set()

    stopper = threading.Thread(target=stop_once_held, daemon=True)
    stopper.start()
    try:
        with pytest.raises(ConnectionLost) as excinfo:
            _register_as_worker_1(service, initialize_s=300.0)
        assert held.is_set()  # the ps went away while it held the wait
        text = str(excinfo.value)
        assert text.startswith("worker:1: the chief has not initialized the variables after ")
        assert ", when a ps task went away: the connection to ps:0 at " in text
        assert "dropped while 'wait_ready' was in flight" in text
        assert "within 300 s" not in text
    finally:
        held.set()  # the stopper ends at once if the wait never reached the service
        stopper.join(30.0)
        if not stopped.is_set():
            stop_services([service])


def test_the_deadline_still_ends_the_wait_with_its_length() -> None:
    service = serve_in_thread(CONFIG, SECRET)
    try:
        with pytest.raises(DeadlineExceeded) as excinfo:
            _register_as_worker_1(service, initialize_s=1.0)
        assert not isinstance(excinfo.value, ConnectionLost)
        text = str(excinfo.value)
        assert text.startswith("worker:1: the chief has not initialized the variables within 1 s")
        assert text.endswith(
            "Is the chief (worker 0) running? Its output, and the ps's, say why it has not."
        )
    finally:
        stop_services([service])
