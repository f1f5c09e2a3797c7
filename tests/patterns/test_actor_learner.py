"""Actor/learner: the sample queue's rules (validation, backpressure, staleness) with
in-process actors, and the CartPole example with actor processes, one killed and replaced."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tensorfleet.patterns.actor_learner import (
    ActorClient,
    SampleQueueServer,
    SampleRejected,
    TensorSpec,
)
from tensorfleet.patterns.broadcast import WeightPublisher, free_address

pytestmark = pytest.mark.timeout(240)

SECRET = b"actor-learner-test-secret-012345"
SPEC = {"obs": TensorSpec(torch.float32, (4,)), "action": TensorSpec(torch.int64)}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cartpole_actor_learner.py"


def batch(rows: int = 3, value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"obs": torch.full((rows, 4), value), "action": torch.zeros(rows, dtype=torch.int64)}


def test_a_batch_of_the_wrong_shape_or_dtype_is_refused_clearly():
    with SampleQueueServer(free_address(), SECRET, SPEC) as queue:
        actor = ActorClient(queue.address, SECRET, "a")
        try:
            assert actor.spec == SPEC
            with pytest.raises(
                SampleRejected,
                match=r"tensor 'obs' has shape \[3, 5\]; the learner expects \[rows, 4\]",
            ):
                actor.push(
                    {"obs": torch.zeros(3, 5), "action": torch.zeros(3, dtype=torch.int64)}, 0
                )
            with pytest.raises(
                SampleRejected, match="tensor 'action' has dtype float32; the learner expects int64"
            ):
                actor.push({"obs": torch.zeros(3, 4), "action": torch.zeros(3)}, 0)
            with pytest.raises(
                SampleRejected,
                match=r"holds tensors \['obs'\]; the learner expects \['action', 'obs'\]",
            ):
                actor.push({"obs": torch.zeros(3, 4)}, 0)
            with pytest.raises(SampleRejected, match="has 2 rows, the others 3"):
                actor.push(
                    {"obs": torch.zeros(3, 4), "action": torch.zeros(2, dtype=torch.int64)}, 0
                )
            assert len(queue) == 0 and queue.refused == 4
            actor.push(batch(), 0)  # the same connection goes on working
            got = queue.get(timeout_s=10)
            assert (
                got.actor == "a"
                and got.rows == 3
                and torch.equal(got.tensors["obs"], torch.ones(3, 4))
            )
        finally:
            actor.close()


def test_a_full_queue_holds_the_push_until_the_learner_takes_a_batch():
    with SampleQueueServer(free_address(), SECRET, SPEC, capacity=1) as queue:
        actor = ActorClient(queue.address, SECRET, "a")
        try:
            actor.push(batch(value=1.0), 0)
            pushed = threading.Event()

            def second_push() -> None:
                actor.push(batch(value=2.0), 0, timeout_s=60)
                pushed.set()

            thread = threading.Thread(target=second_push)
            thread.start()
            deadline = time.monotonic() + 30
            while queue.held_pushes == 0:
                assert time.monotonic() < deadline, "the second push was not held"
                time.sleep(0.005)
            assert not pushed.is_set() and len(queue) == 1, "backpressure: the actor waits"
            assert queue.get(timeout_s=10).tensors["obs"][0, 0] == 1.0
            assert pushed.wait(30), "taking a batch lets the held push in"
            thread.join(timeout=30)
            assert queue.get(timeout_s=10).tensors["obs"][0, 0] == 2.0
        finally:
            actor.close()


def test_stale_batches_are_dropped_and_fresh_ones_kept():
    with SampleQueueServer(free_address(), SECRET, SPEC) as queue:
        actor = ActorClient(queue.address, SECRET, "a")
        try:
            for version in (0, 3, 5):
                actor.push(batch(value=float(version)), version)
            got = queue.get(timeout_s=10, min_version=4)  # learner at 6 with max_lag 2
            assert got.version == 5 and queue.dropped_stale == 2
            assert queue.get(timeout_s=0.05) is None, "a learner's wait ends; nothing blocks it"
        finally:
            actor.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_actors_follow_the_newest_weights_and_stamp_their_version(encrypt):
    with (
        WeightPublisher(free_address(), SECRET, encrypt=encrypt) as publisher,
        SampleQueueServer(
            free_address(), SECRET, SPEC, weights_address=publisher.address, encrypt=encrypt
        ) as queue,
    ):
        actor = ActorClient(queue.address, SECRET, "a", encrypt=encrypt)
        try:
            for v in range(3):
                publisher.publish({"w": torch.full((2,), float(v))})
            snapshot = actor.newest_weights(wait_s=10)
            assert snapshot.version == 3 and actor.version == 3
            actor.push(batch(), actor.version)
            assert queue.get(timeout_s=10).version == 3
        finally:
            actor.close()


def _example():
    spec = importlib.util.spec_from_file_location("cartpole_actor_learner", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_cartpole_actors_and_a_learner_reach_the_test_target_with_an_actor_replaced(tmp_path):
    pytest.importorskip("gymnasium")
    example = _example()
    # Test-sized: greedy mean return >= 150 over 20 episodes within 40,000 steps (the
    # example's own target is 475 over 100 episodes).
    settings = example.Settings(seed=0, max_steps=40_000, target=150.0, eval_episodes=20)
    address = free_address()
    env = dict(os.environ, TENSORFLEET_SECRET=SECRET.decode())
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("actor-0", "actor-1", "actor-2")}

    def start(name: str, seed: int) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLE),
                "--role",
                "actor",
                "--learner",
                address,
                "--name",
                name,
                "--seed",
                str(seed),
            ],
            env=env,
            stdout=logs[name],
            stderr=subprocess.STDOUT,
        )

    actors = {"actor-0": start("actor-0", 1), "actor-1": start("actor-1", 2)}
    events: list[str] = []

    def on_update(version: int, queue) -> None:
        if version == 10:  # kill one actor mid-training; the learner must go on
            actors["actor-0"].send_signal(signal.SIGKILL)
            actors["actor-0"].wait(timeout=30)
            events.append(f"killed actor-0 at version {version}")
        if version == 15:  # a replacement joins
            actors["actor-2"] = start("actor-2", 3)
            events.append(f"started actor-2 at version {version}")

    lines: list[str] = []
    try:
        figures = example.run_learner(
            address,
            SECRET,
            settings,
            log=lines.append,
            on_update=on_update,
            # Reaching the target ends training only once the replacement's batches came in.
            may_stop=lambda queue: queue.accepted_by["actor-2"] > 0,
        )
    finally:
        for process in actors.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
        for f in logs.values():
            f.close()
    transcript = "\n".join(lines + events) + "".join(
        f"\n--- {name}\n" + (tmp_path / f"{name}.log").read_text()[-2000:] for name in logs
    )
    assert figures["evaluation"] >= 150.0, transcript
    assert len(events) == 2, transcript
    assert figures["batches_by_actor"].get("actor-2", 0) > 0, (
        "the replacement actor joined\n" + transcript
    )
    assert figures["batches_by_actor"].get("actor-1", 0) > 0, transcript
