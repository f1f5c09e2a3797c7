"""Model broadcast over the wire: newest version after missed ones, a stalled subscriber
that does not hold the publisher back, a wrong secret refused without harm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tensorfleet.errors import AuthenticationError
from tensorfleet.patterns.broadcast import WeightPublisher, WeightSubscriber, free_address

pytestmark = pytest.mark.timeout(120)

SECRET = b"broadcast-test-secret-0123456789"
PROGRAMS = Path(__file__).parent / "programs"


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def weights(version: int, n: int = 8) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), float(version)), "b": torch.tensor([version], dtype=torch.int64)}


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_a_subscriber_gets_the_newest_version_after_missing_several(encrypt):
    with WeightPublisher(free_address(), SECRET, encrypt=encrypt) as publisher:
        with WeightSubscriber(publisher.address, SECRET, encrypt=encrypt) as subscriber:
            assert subscriber.newest() is None, "nothing published yet"
            publisher.publish(weights(1), {"global_step": 10})
            first = subscriber.newest()
            assert first.version == 1 and first.meta == {"global_step": 10}
            for v in range(2, 8):
                publisher.publish(weights(v))
            newest = subscriber.newest()
            assert newest.version == 7, "versions 2..6 are skipped, 7 is received"
            assert torch.equal(newest.tensors["w"], torch.full((8,), 7.0))
            assert newest.tensors["b"].dtype == torch.int64 and newest.tensors["b"].item() == 7
            assert subscriber.newest() is None, "nothing newer than 7"

            # A waiting subscriber is answered as soon as the next version is published.
            def publish_when_waited_on() -> None:
                wait_until(lambda: publisher.waiting == 1, 20, "the subscriber's held request")
                publisher.publish(weights(8))

            thread = threading.Thread(target=publish_when_waited_on)
            thread.start()
            snapshot = subscriber.newest(wait_s=30)
            thread.join(timeout=30)
            assert snapshot is not None and snapshot.version == 8
            model = torch.nn.Linear(2, 1)
            publisher.publish_model(model)
            other = torch.nn.Linear(2, 1)
            assert subscriber.load_into(other) == 9
            assert torch.equal(other.weight, model.weight)


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_a_stalled_subscriber_does_not_hold_back_the_publisher(encrypt):
    """Encrypted too: sealed 16 MB snapshots, a stalled encrypting subscriber."""
    big = 4 * 1024 * 1024  # 16 MB per snapshot: more than the kernel's socket buffers hold
    versions = 20
    with WeightPublisher(free_address(), SECRET, encrypt=encrypt) as publisher:
        tensor = torch.zeros(big)
        publisher.publish({"w": tensor})
        # A subscriber process that receives version 1 and is then frozen (SIGSTOP): its
        # socket stops reading, with a request in flight or a snapshot half sent.
        stalled = subprocess.Popen(
            [sys.executable, str(PROGRAMS / "subscriber.py"), publisher.address],
            env=dict(
                os.environ,
                TENSORFLEET_SECRET=SECRET.decode(),
                TENSORFLEET_ENCRYPT="1" if encrypt else "0",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        live = WeightSubscriber(publisher.address, SECRET, encrypt=encrypt)
        try:
            assert stalled.stdout.readline().strip() == "version 1", (
                "the subscriber process did not start"
            )
            stalled.send_signal(signal.SIGSTOP)
            received: list[int] = []
            for v in range(2, versions + 1):
                tensor.fill_(v)
                assert publisher.publish({"w": tensor}) == v
                snapshot = live.newest(wait_s=10.0)  # the live one keeps up, version by version
                received.append(snapshot.version)
                assert torch.equal(snapshot.tensors["w"][:3], torch.full((3,), float(v)))
            # Every version was published and delivered to the live subscriber while the
            # stalled one held its socket full.
            assert publisher.published == versions
            assert received == list(range(2, versions + 1))
            # Thawed, the stalled subscriber skips what it missed and gets the newest.
            stalled.send_signal(signal.SIGCONT)
            seen = []
            while not seen or seen[-1] != versions:
                line = stalled.stdout.readline().strip()
                assert line.startswith("version "), f"subscriber process said {line!r}"
                seen.append(int(line.split()[1]))
                assert len(seen) <= 2, f"it should skip to {versions}, got {seen}"
        finally:
            live.close()
            stalled.kill()
            stalled.wait(timeout=30)
        # The publisher goes on serving after the stalled subscriber died.
        with WeightSubscriber(publisher.address, SECRET, encrypt=encrypt) as late:
            publisher.publish({"w": torch.ones(4)})
            assert late.wait_for(versions + 1, timeout_s=30).version == versions + 1


def test_a_subscriber_with_the_wrong_secret_is_refused_and_the_publisher_unaffected():
    with WeightPublisher(free_address(), SECRET) as publisher:
        publisher.publish(weights(1))
        with pytest.raises(AuthenticationError, match="secret mismatch"):
            WeightSubscriber(publisher.address, b"not-the-secret-at-all-0123456789", timeout_s=20)
        wait_until(lambda: publisher.rejected.get("auth", 0) >= 1, 20, "the refusal to be counted")
        publisher.publish(weights(2))
        with WeightSubscriber(publisher.address, SECRET) as subscriber:
            assert subscriber.newest().version == 2
