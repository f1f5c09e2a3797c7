"""The ps task's :class:`ModelRouter` over the wire, with real clients: two models in their
own namespaces on one ps (same variable name, other shapes, separate global steps), one
model ending without waiting for the other's workers, the ps ending once both are over (no
default model holds it), and the refusals: a second training claiming a model's name, a
request for a model nobody said hello for, a malformed name."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tensorfleet.errors import NotInitialized, RemoteProtocolError, RequestRefused
from tensorfleet.launch.ports import free_port
from tensorfleet.optim import SGD
from tensorfleet.ps.model_namespace import ModelClaim, fingerprint
from tensorfleet.ps.model_router import ModelRouter
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.service_settings import ServiceSettings
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.version import __version__
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.message import PROTOCOL_VERSION
from tensorfleet.wire.service_socket import ServiceSocket
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.timeouts import ClientTimeouts

pytestmark = pytest.mark.timeout(60)

SECRET = b"r" * 32
WORKERS = ("worker:0", "worker:1", "worker:2")
TIMEOUTS = ClientTimeouts(connect_s=10.0, initialize_s=10.0, step_s=10.0, recover_s=5.0)


class RunningRouter:
    def __init__(self, workers: tuple[str, ...] = WORKERS) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        config = ServiceConfig(0, workers, idle_timeout_s=60.0, end_grace_s=60.0)
        self.socket = ServiceSocket(self.address, SECRET, config.limits)
        self.router = ModelRouter(self.socket, config)
        self.stop = threading.Event()
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.result["outcome"] = self.router.serve(self.stop)
        except BaseException as exc:  # reported by the test
            self.result["error"] = exc

    def state(self, model: str) -> tuple[dict, dict, int]:
        """A model's values, optimizer state and version (read while nothing is in flight)."""
        store = self.router.models[model].store
        values, _, optimizer = store.checkpoint_parts(copy=True)
        return values, optimizer, store.version


def serving_router() -> Iterator[RunningRouter]:
    """A router serving on a thread until the test ends; then stopped, and checked that it
    stopped without an error (the body of the ``router`` fixtures)."""
    running = RunningRouter()
    try:
        yield running
    finally:
        running.stop.set()
        running.thread.join(5.0)
        running.socket.close()
        assert not running.thread.is_alive(), "the router did not stop"
        assert "error" not in running.result, running.result["error"]


@pytest.fixture
def router() -> Iterator[RunningRouter]:
    yield from serving_router()


class Trainer:
    """One worker of one model: a single variable ``w`` of ``shape``, plain SGD."""

    def __init__(
        self, address: str, task: str, model: str, workers: tuple[str, ...], shape: tuple[int, ...]
    ) -> None:
        self.w = torch.nn.Parameter(torch.ones(shape))
        named = [("w", self.w)]
        digest, summary = fingerprint([("w", shape, "float32")])
        self.claim = ModelClaim(model, workers, digest, summary)
        self.plan = plan_placement([VariableSpec("w", shape, "float32", 4)], 1)
        self.client = ParameterClient([address], SECRET, task, TIMEOUTS, model=self.claim)
        self.named = named

    def start(self) -> int:
        self.client.connect()
        return self.client.register(
            self.named, self.plan, SGD(lr=0.5), is_chief=self.claim.chief == self.client.task_name,
            discipline=UpdateDiscipline(),
        )  # fmt: skip

    def step(self, gradient: float):
        self.w.grad = torch.full_like(self.w, gradient)
        return self.client.push_pull()


def test_two_models_share_a_ps_each_with_its_own_variables_step_and_end(router):
    a = Trainer(router.address, "worker:0", "trial-a", ("worker:0",), (3,))
    b = Trainer(router.address, "worker:1", "trial-b", ("worker:1", "worker:2"), (2, 5))
    b2 = Trainer(router.address, "worker:2", "trial-b", ("worker:1", "worker:2"), (2, 5))
    try:
        assert a.start() == 0 and b.start() == 0 and b2.start() == 0
        assert a.step(1.0).global_step == 1
        assert a.step(1.0).global_step == 2
        assert b.step(2.0).global_step == 1  # its own global step
        assert torch.equal(a.w.detach(), torch.zeros(3))  # 1 - 0.5 - 0.5
        assert torch.equal(b.w.detach(), torch.zeros(2, 5))  # 1 - 0.5 * 2
        a.client.finish(declare_end=True)  # model a's end waits for a's workers only
        assert _eventually(lambda: router.router.over == {"trial-a": "finished"}), (
            router.router.over
        )
        assert router.thread.is_alive(), "the ps ended while model trial-b still trains"
        progress = b2.step(0.0)
        assert progress.global_step == 2 and not progress.stop
        b2.client.finish(declare_end=False)
        b.client.finish(declare_end=True)
        router.thread.join(10.0)
        assert not router.thread.is_alive(), "the ps did not end once both models were over"
        outcome = router.result["outcome"]
        assert outcome.reason == "finished"
        assert outcome.models == {"trial-a": 2, "trial-b": 2}
    finally:
        for trainer in (a, b, b2):
            trainer.client.close()


def _eventually(condition, timeout_s: float = 5.0) -> bool:
    """Whether ``condition()`` holds within ``timeout_s`` (the router marks a model over in
    the loop iteration after its last ``done``)."""
    event = threading.Event()
    deadline = timeout_s
    while deadline > 0 and not condition():
        event.wait(0.05)
        deadline -= 0.05
    return condition()


@pytest.mark.parametrize(
    ("task", "workers", "shape", "seen"),
    [
        # another group of workers takes the same name, with other shapes
        ("worker:2", ("worker:2",), (4, 4), "worker:2 claims it for workers worker:2 with 1 variables: w float32[4, 4]"),
        # a worker of the model that builds another model
        ("worker:1", ("worker:0", "worker:1"), (7,), "worker:1 claims it for workers worker:0, worker:1 with 1 variables: w float32[7]"),
    ],
)  # fmt: skip
def test_a_second_training_claiming_a_model_name_is_refused_naming_both(
    router, task, workers, shape, seen
):
    first = Trainer(router.address, "worker:0", "trial-3", ("worker:0", "worker:1"), (3,))
    second = Trainer(router.address, task, "trial-3", workers, shape)
    try:
        first.client.connect()
        with pytest.raises(RequestRefused) as excinfo:
            second.client.connect()
        text = str(excinfo.value)
        assert "two trainings claim model 'trial-3'" in text, text
        assert "trained by workers worker:0, worker:1 with 1 variables: w float32[3]" in text, text
        assert seen in text, text
        assert "Give each training its own model_name" in text
        assert list(router.router.models) == ["trial-3"]  # nothing else opened
    finally:
        first.client.close()
        second.client.close()


def test_requests_for_an_unopened_or_malformed_model_are_refused(router):
    channel = Channel(router.address, SECRET, "ps:0")
    try:
        hello = {"protocol": PROTOCOL_VERSION, "version": __version__, "task": "worker:0"}
        channel.call("hello", hello, None, 5.0)  # opens the default model only
        with pytest.raises(
            NotInitialized, match="ps:0 holds no model 'ghost': none of its workers"
        ):
            channel.call("pull", {"task": "worker:0", "model": "ghost"}, None, 5.0)
        with pytest.raises(RemoteProtocolError, match="model_name must be 1 to 64"):
            channel.call("hello", {"task": "worker:0", "model": "../etc"}, None, 5.0)
        with pytest.raises(RemoteProtocolError, match="'model_workers' must list distinct workers"):
            channel.call(
                "hello",
                {"task": "worker:0", "model": "m", "model_workers": ["worker:9"]},
                None,
                5.0,
            )
        assert list(router.router.models) == [""]
    finally:
        channel.close()


def test_every_setting_of_the_task_reaches_each_models_service() -> None:
    """A model's service is opened with the task's settings (a setting left out would be
    silently back at its default: ``--max-memory`` once was, for every model)."""
    settings = ServiceSettings(
        idle_timeout_s=61.0,
        end_grace_s=7.0,
        liveness_timeout_s=9.0,
        max_memory=12_345_678,
        preempt_grace_s=3.0,
    )
    config = ServiceConfig.for_shard(0, WORKERS, settings)
    address = f"127.0.0.1:{free_port()}"
    socket = ServiceSocket(address, SECRET, config.limits)
    try:
        service = ModelRouter(socket, config)._open(ModelClaim("trial-1", ("worker:1",)))
    finally:
        socket.close()
    assert service.config.settings == settings
    assert service.config.worker_tasks == ("worker:1",) and service.config.model == "trial-1"
