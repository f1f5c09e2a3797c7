"""A preempted worker's wait for a step's exchange is bounded (``worker/shard_fanout.py``):
a push still unanswered some seconds after the SIGTERM ends with ConnectionLost naming the
preemption, while the ps answers heartbeats (the silence rule never fires); before a
preemption the same wait lasts its deadline, and a ``save`` (the chief's checkpoint after a
preemption) keeps its deadline too.

The ps here is a bare ZeroMQ ROUTER that reads every request and answers none: a ps alive
but not answering the push, as the stuck worker of the 10-minute storm of seed 6 saw it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from tensorfleet.errors import ConnectionLost, DeadlineExceeded
from tensorfleet.preemption_event import clear_preempted, mark_preempted
from tensorfleet.wire.channel import Channel
from tensorfleet.worker import shard_fanout
from tensorfleet.worker.shard_fanout import ShardFanout

pytestmark = pytest.mark.timeout(60)
SECRET = b"preempted-exchange-unit-test-secret-00"


class AliveHeartbeat:
    """A heartbeat that hears the ps: no silence, no restart."""

    def trouble(self, shard: int, session: bytes | None) -> str | None:
        return None


@pytest.fixture
def deaf_ps() -> Iterator[str]:
    """The address of a ROUTER socket that takes every request and answers none."""
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        router.close()
        clear_preempted()


def _fanout(address: str) -> ShardFanout:
    channel = Channel(address, SECRET, "ps:0", shared_memory=False)
    return ShardFanout([channel], AliveHeartbeat())  # type: ignore[arg-type]


def test_a_preempted_push_is_given_up_after_the_grace_and_a_save_keeps_its_deadline(
    deaf_ps: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_fanout, "EXCHANGE_GRACE_AFTER_PREEMPTION_S", 0.5)
    fanout = _fanout(deaf_ps)
    try:
        mark_preempted()
        started = time.monotonic()
        with pytest.raises(ConnectionLost, match="preempted .* has not answered its 'push'"):
            fanout.call("push", {}, timeout_s=20.0)
        assert time.monotonic() - started < 10.0  # not the push's 22 s deadline
        # The same through send/wait, as a bucket of the backward pass waits for its reply.
        request_id = fanout.send(0, "push_rows", {}, 20.0)
        with pytest.raises(ConnectionLost, match="'push_rows'"):
            fanout.wait(0, request_id, 20.0)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="'save'"):
            fanout.call("save", {}, timeout_s=1.0)  # its own deadline: 1 s + the margin
        assert time.monotonic() - started >= 1.0 + shard_fanout.ANSWER_MARGIN_S - 0.1
    finally:
        for channel in fanout.channels:
            channel.close()


def test_a_push_is_not_given_up_before_a_preemption(
    deaf_ps: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_fanout, "EXCHANGE_GRACE_AFTER_PREEMPTION_S", 0.0)
    monkeypatch.setattr(shard_fanout, "ANSWER_MARGIN_S", 0.0)
    fanout = _fanout(deaf_ps)
    try:
        with pytest.raises(DeadlineExceeded, match="'push'"):  # the deadline, not the rule
            fanout.call("push", {}, timeout_s=1.0)
    finally:
        for channel in fanout.channels:
            channel.close()
