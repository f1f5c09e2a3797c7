"""The worker's heartbeat: what it says about a ps it cannot reach, and that a shard which
answered the client itself (a recovery's hello) counts as heard from, from the process that
answered, before the heartbeat thread's own next beat reaches it."""

from __future__ import annotations

import time

import pytest
import zmq

from tensorfleet.launch.ports import free_port
from tensorfleet.worker.heartbeat import Heartbeat

pytestmark = pytest.mark.timeout(30)

SECRET = b"heartbeat-unit-test-secret-000000000000"


def test_a_shard_heard_by_the_client_is_no_longer_reported_silent_or_restarted() -> None:
    context = zmq.Context()
    # Nothing listens at the address: every beat goes unanswered.
    heartbeat = Heartbeat(
        [f"127.0.0.1:{free_port()}"],
        SECRET,
        "worker:0",
        "instance-1",
        context,
        interval_s=0.05,
        silence_s=0.2,
    )
    try:
        assert heartbeat.trouble(0, b"old") is None  # not running yet: nothing to say
        heartbeat.start()
        heartbeat.heard(0, b"old")
        assert heartbeat.trouble(0, b"old") is None
        assert "restarted" in (heartbeat.trouble(0, b"new") or "")
        deadline = time.monotonic() + 10.0
        while (reason := heartbeat.trouble(0, b"old")) is None:
            assert time.monotonic() < deadline, "an unreachable ps was never reported silent"
            time.sleep(0.05)
        assert reason.startswith("ps:0 has not answered a heartbeat for")
        heartbeat.heard(0, b"new")  # the restarted process answered the client's hello
        assert heartbeat.trouble(0, b"new") is None
    finally:
        heartbeat.stop()
        context.term()


def test_a_process_that_was_itself_stopped_blames_no_shard_for_the_silence() -> None:
    """After this process was stopped (SIGSTOP) the shards' last answers are as old as the
    stop: no shard is reported silent while the heartbeat thread has not run for its stall
    limit, and after it runs again silence counts from then; a shard that stays silent while
    the thread runs is still reported."""
    context = zmq.Context()
    heartbeat = Heartbeat(
        [f"127.0.0.1:{free_port()}"],  # nothing listens: no beat is ever answered
        SECRET,
        "worker:0",
        "instance-1",
        context,
        interval_s=0.05,
        silence_s=0.5,
    )
    try:
        heartbeat.start()
        # The state a SIGSTOP of 20 s leaves: no round and no answer for 20 s.
        stopped_at = time.monotonic() - 20.0
        heartbeat._silence.last_ran = heartbeat._last_answer[0] = stopped_at
        assert heartbeat.trouble(0, None) is None  # the silence is ours
        heartbeat._silence.ran()  # the thread runs again (as its loop does at once after SIGCONT)
        assert heartbeat.trouble(0, None) is None  # silence counts from the resumption
        deadline = time.monotonic() + 10.0
        while (reason := heartbeat.trouble(0, None)) is None:
            assert time.monotonic() < deadline, "a ps silent while we ran was never reported"
            time.sleep(0.05)
        assert reason.startswith("ps:0 has not answered a heartbeat for")
        assert float(reason.split(" for ")[1].split(" s")[0]) < 5.0  # not the stop's 20 s
    finally:
        heartbeat.stop()
        context.term()
