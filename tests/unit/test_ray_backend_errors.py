"""The Ray backend's refusals before anything starts, with the real ``ray`` package and no
Ray cluster: each message reads as sentences (no doubled full stop after Ray's own reason),
and docs/howto/ray.md quotes each one as it really is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tensorfleet.errors import LaunchConfigError
from tensorfleet.launch.ports import free_ports
from tests.machine_locks import machine_lock

ray = pytest.importorskip("ray")

from tensorfleet.launch.backends.ray import RayBackend  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DOC = Path(__file__).resolve().parents[2] / "docs" / "howto" / "ray.md"


def quoted_errors() -> list[str]:
    """The ``tensorfleet: error: ...`` lines the Ray how-to quotes."""
    return [line for line in DOC.read_text().splitlines() if line.startswith("tensorfleet: error:")]


def refusal(address: str | None) -> str:
    with pytest.raises(LaunchConfigError) as refused:
        RayBackend(address)
    return str(refused.value)


def test_the_default_address_error_has_no_doubled_full_stop_and_the_doc_quotes_it(monkeypatch):
    """No --ray-address and no $RAY_ADDRESS: Ray looks for a cluster on this machine, finds
    none, and says so ending with a full stop; tensorfleet's sentence goes on after it.
    Under the machine's ``ray`` lock: the Ray test of another test process would be found."""
    from ray._private import services

    with machine_lock("ray"):
        if services.find_gcs_addresses() or services.find_bootstrap_address(None):
            pytest.skip("a Ray cluster runs on this machine: the default address would find it")
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        message = refusal(None)
    assert ".." not in message, message
    assert message.startswith(
        "cannot connect to the Ray cluster at 'auto' (the default: no --ray-address given and "
        "$RAY_ADDRESS not set): "
    )
    assert message.endswith(
        "environment variable. Start one with `ray start --head` and pass the address it "
        "prints (--ray-address HOST:PORT)"
    )
    assert f"tensorfleet: error: {message}" in quoted_errors()


def test_the_doc_quotes_the_does_not_answer_error_as_it_is():
    (port,) = free_ports(1)  # nothing listens there
    message = refusal(f"127.0.0.1:{port}")
    assert "check it with `ray status --address" in message
    quoted = [line for line in quoted_errors() if "does not answer" in line]
    assert len(quoted) == 1
    doc_port = re.search(r"127\.0\.0\.1:(\d+)", quoted[0]).group(1)
    assert quoted[0].replace(doc_port, str(port)) == f"tensorfleet: error: {message}"


class _FakeRay:
    """What RayBackend.allocate calls of ray, recording each actor's GPUs."""

    class exceptions:  # noqa: N801 - ray.exceptions
        GetTimeoutError = TimeoutError

    def __init__(self) -> None:
        self.actor_gpus: list[float] = []

    def remote(self, cls: type) -> _FakeRay:
        return self

    def options(self, **options: object) -> _FakeActorClass:
        return _FakeActorClass(self, float(options["num_gpus"]))  # type: ignore[arg-type]

    def get(self, refs: list[str], timeout: float) -> list[str]:
        return refs


class _FakeActorClass:
    def __init__(self, ray: _FakeRay, gpus: float) -> None:
        self.ray, self.gpus = ray, gpus

    def remote(self) -> object:
        self.ray.actor_gpus.append(self.gpus)
        address = f"10.0.0.{len(self.ray.actor_gpus)}:2222"
        return type("Actor", (), {"reserve_address": type("M", (), {"remote": lambda: address})})


def test_ray_workers_reserve_their_gpus_and_ps_tasks_none():
    backend = RayBackend.__new__(RayBackend)  # no Ray cluster: allocate against a fake
    backend._ray, backend._actors, backend._hosts = _FakeRay(), {}, {}
    backend.cpus_per_task, backend.gpus_per_task, backend.address = 1.0, 1.0, "fake"
    addresses = backend.allocate(["ps:0", "worker:0", "worker:1", "ps:1"])
    assert backend._ray.actor_gpus == [0.0, 1.0, 1.0, 0.0]
    assert addresses == [f"10.0.0.{i}:2222" for i in (1, 2, 3, 4)]
    assert backend.gpus_for("worker:7") == 1.0 and backend.gpus_for("ps:0") == 0.0
