"""A ps that restarts while the worker saves a checkpoint or ends training does not end the
worker with an error: the client recovers (says hello again, the chief re-creates the empty
shard) and the interrupted operation completes on the new ps process. The ps "restart" is a
real service stopped and started again on the same address, in a thread."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from tensorfleet.launch.ports import free_port
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ServiceConfig, ServiceOutcome
from tensorfleet.ps.update_rules import SGD
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.timeouts import ClientTimeouts

from .service_harness import RunningService, serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(60)

SECRET = b"client-recovery-unit-test-secret-0000000"
CONFIG = ServiceConfig(shard_index=0, worker_tasks=("worker:0",))
TIMEOUTS = ClientTimeouts(
    connect_s=10.0,
    initialize_s=10.0,
    step_s=10.0,
    recover_s=30.0,
    # Each test waits once for the stopped ps's silence to be noticed: 8 missed heartbeats,
    # still generous for a live ps serving from a thread of this process on a shared machine.
    heartbeat_s=0.25,
    ps_silence_s=2.0,
)


class _RecoveryStarted(logging.Handler):
    """Sets ``event`` when the client logs that it is recovering."""

    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().endswith("; recovering"):
            self.event.set()


@pytest.fixture
def restarted_ps() -> Iterator[Callable[[RunningService], None]]:
    """Arms a restart: the given ps is stopped now, and started again (empty, same address)
    as soon as the client says it is recovering from its silence."""
    handler = _RecoveryStarted()
    logger = logging.getLogger("tensorfleet.worker")
    logger.addHandler(handler)
    started: list[RunningService] = []
    threads: list[threading.Thread] = []

    def arm(old: RunningService, starting_s: float = 0.0) -> None:
        """``starting_s``: how long the new process takes to start listening (a real ps
        imports torch first), counted from the client's "recovering"."""
        stop_services([old])

        def restart() -> None:
            if handler.event.wait(20.0):
                time.sleep(starting_s)
                started.append(serve_in_thread(CONFIG, SECRET, old.address))

        thread = threading.Thread(target=restart, daemon=True)
        thread.start()
        threads.append(thread)

    arm.started = started  # type: ignore[attr-defined]
    try:
        yield arm
    finally:
        logger.removeHandler(handler)
        handler.event.set()
        for thread in threads:
            thread.join(25.0)
        stop_services(started)


def _chief() -> tuple[RunningService, ParameterClient, list[tuple[str, torch.nn.Parameter]]]:
    service = serve_in_thread(CONFIG, SECRET)
    model = [("w", torch.nn.Parameter(torch.ones(3, 2))), ("b", torch.nn.Parameter(torch.zeros(2)))]
    plan = plan_placement([VariableSpec(n, tuple(p.shape), "float32", 4) for n, p in model], 1)
    client = ParameterClient([service.address], SECRET, "worker:0", TIMEOUTS)
    client.connect()
    client.register(model, plan, SGD(lr=0.5), is_chief=True)
    for _, param in model:
        param.grad = torch.ones_like(param)
    assert client.push_pull().global_step == 1
    return service, client, model


def test_a_ps_restart_during_save_is_recovered_and_the_save_completes(
    restarted_ps: Callable[[RunningService], None],
) -> None:
    service, client, model = _chief()
    try:
        restarted_ps(service)  # the ps dies now; it comes back while save() waits on it
        global_step, documents = client.save()
        assert len(documents) == 1 and len(documents[0]) > 0
        # The new ps was re-created from the chief's current values, which the save holds.
        assert torch.equal(model[0][1].detach(), torch.full((3, 2), 0.5))
        assert client.pull().global_step == global_step
        client.finish(declare_end=True)
    finally:
        client.close()
    (new,) = restarted_ps.started  # type: ignore[attr-defined]
    assert new.outcome() == ServiceOutcome("finished", global_step)


def test_a_ps_restart_during_the_chiefs_end_of_training_is_recovered(
    restarted_ps: Callable[[RunningService], None],
) -> None:
    service, client, _ = _chief()
    final_checkpoints: list[int] = []
    try:
        restarted_ps(service)  # the ps dies as training ends; it comes back during finish()
        running = client.finish(
            declare_end=True, before_done=lambda: final_checkpoints.append(client.save()[0])
        )
        assert running == []
    finally:
        client.close()
    assert len(final_checkpoints) == 1  # the final checkpoint was written once, on the new ps
    (new,) = restarted_ps.started  # type: ignore[attr-defined]
    assert new.outcome().reason == "finished"


def test_a_shard_recreated_without_a_checkpoint_keeps_the_global_step(
    restarted_ps: Callable[[RunningService], None],
) -> None:
    """No checkpoint: the chief re-creates the restarted shard from its current values, and
    the global step goes on from where it was instead of starting again at 0."""
    service, client, model = _chief()
    try:
        for _, param in model:
            param.grad = torch.ones_like(param)
        assert client.push_pull().global_step == 2
        restarted_ps(service)  # the ps dies now and comes back empty
        assert client.pull().global_step == 2
        for _, param in model:
            param.grad = torch.ones_like(param)
        assert client.push_pull().global_step == 3
        client.finish(declare_end=True)
    finally:
        client.close()


HELLO_HOLDER = r"""
import sys
from tensorfleet.wire.service_socket import ServiceSocket
service = ServiceSocket(sys.argv[1], sys.argv[2].encode())
while True:
    if service.poll(1.0) and (request := service.receive()) is not None:
        print("holding", request.op, flush=True)  # never answers: killed while it holds it
"""


def test_a_ps_killed_while_a_hello_is_in_flight_is_asked_again_until_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker starting while its ps is killed or restarting (a fault storm, a cluster
    recovering): the connection drops with the hello in flight. The worker says so and asks
    again until connect_s has passed, instead of failing (exit 2 stopped the cluster)."""
    address, secret = f"127.0.0.1:{free_port()}", "a-secret-for-the-hello-retry-test!"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HELLO_HOLDER, address, secret],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    client = ParameterClient([address], secret.encode(), "worker:0", ClientTimeouts(connect_s=60))
    services: list[RunningService] = []
    connected: list[object] = []
    try:
        worker = threading.Thread(target=lambda: connected.append(_connect(client)), daemon=True)
        with caplog.at_level(logging.WARNING, logger="tensorfleet"):
            worker.start()
            line = holder.stdout.readline()
            assert line.split() == ["holding", "hello"], f"{line!r}; {holder.stderr.read()}"
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
            services.append(serve_in_thread(CONFIG, secret.encode(), address))
            worker.join(60)
        assert connected and not isinstance(connected[0], BaseException), connected
        assert any(
            "dropped while 'hello' was in flight" in r.getMessage()
            and "asking again" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
    finally:
        client.close()
        stop_services(services)
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


def _connect(client: ParameterClient) -> object:
    try:
        return client.connect()
    except BaseException as exc:  # handed to the test's thread
        return exc


def test_a_ps_back_after_its_silence_was_noticed_is_recovered_by_the_first_hello(
    restarted_ps: Callable[..., None], caplog: pytest.LogCaptureFixture
) -> None:
    """The ps is gone long enough for the heartbeat to report it silent, then comes back
    while the client recovers: the recovery's hello is not given up for that silence (ZeroMQ
    delivers it once the new ps listens), so one hello recovers, with no "not recovered yet"
    round; and the requests after it are not given up for the heartbeat's view of the old
    process either: one recovery in all."""
    service, client, model = _chief()
    try:
        stop_services([service])
        deadline = time.monotonic() + 20.0
        while not client._heartbeat.trouble(0, client._shards.channels[0].server_session):
            assert time.monotonic() < deadline, "the heartbeat never reported the stopped ps"
            time.sleep(0.05)
        with caplog.at_level(logging.WARNING, logger="tensorfleet"):
            # It listens again 1.5 s after the client said it is recovering: a new process
            # starting, while the heartbeat still reports the old one silent.
            restarted_ps(service, 1.5)
            assert client.pull().global_step == 1
            for _, param in model:
                param.grad = torch.ones_like(param)
            assert client.push_pull().global_step == 2
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if "not recovered yet" in m], messages
        assert len([m for m in messages if m.endswith("; recovering")]) == 1, messages
        client.finish(declare_end=True)
    finally:
        client.close()
