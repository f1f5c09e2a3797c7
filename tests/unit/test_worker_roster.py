"""The :class:`WorkerRoster` on its own, on a fake clock: who counts as a worker, alive, lost,
done and running, and which process holds each task's identity (claims, refusals,
takeover, and the refusal of a superseded process's later requests)."""

from __future__ import annotations

import logging

import pytest

from tensorfleet.errors import ConfigError, IdentityInUse, ProtocolError, TensorfleetError
from tensorfleet.ps.worker_roster import MAX_SESSIONS, LivenessChange, WorkerRoster

WORKERS = ("worker:0", "worker:1", "worker:2")
LIVENESS_S = 15.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_for(roster: WorkerRoster, clock: FakeClock, seconds: float) -> None:
    """``seconds`` pass while the shard's loop runs: it checks liveness at least every 0.2 s,
    here every second (a longer gap between checks is the shard's own stall)."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + 1.0)
        roster.check_liveness()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def roster(clock: FakeClock) -> WorkerRoster:
    return WorkerRoster(WORKERS, LIVENESS_S, shard="ps:0", clock=clock)


def test_worker_of_names_the_operation_the_task_and_the_workers(roster: WorkerRoster) -> None:
    assert roster.worker_of("push", "worker:1") == "worker:1"
    for task in (None, "worker:9", "ps:0", 3, ["worker:0"]):
        with pytest.raises(ProtocolError) as excinfo:
            roster.worker_of("done", task)
        assert str(excinfo.value) == (
            f"done from unknown task {task!r}; workers are ['worker:0', 'worker:1', 'worker:2']"
        )


def test_a_liveness_timeout_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"liveness_timeout_s must be > 0, got 0"):
        WorkerRoster(WORKERS, 0)
    assert issubclass(ConfigError, TensorfleetError) and issubclass(ConfigError, ValueError)


def test_a_silent_worker_is_lost_and_back_when_heard(
    roster: WorkerRoster, clock: FakeClock
) -> None:
    roster.heard_from("worker:0")
    roster.heard_from("worker:1")
    roster.heard_from("worker:7")  # not a worker: ignored
    assert set(roster.heard) == {"worker:0", "worker:1"}
    clock.now += LIVENESS_S  # exactly the timeout: not yet
    assert roster.check_liveness() == LivenessChange()
    roster.heard_from("worker:1")
    clock.now += 0.5
    change = roster.check_liveness()
    assert change == LivenessChange(newly_lost=("worker:0",)) and change.changed
    assert roster.lost == {"worker:0"}
    assert roster.running() == ["worker:1", "worker:2"]  # never heard: not lost
    assert roster.check_liveness() == LivenessChange()  # reported once
    roster.heard_from("worker:0")
    assert roster.check_liveness() == LivenessChange(back=("worker:0",))
    assert roster.lost == set()


def test_a_done_worker_is_never_lost_and_not_running(
    roster: WorkerRoster, clock: FakeClock
) -> None:
    roster.heard_from("worker:0")
    roster.heard_from("worker:2")
    clock.now += LIVENESS_S + 1
    roster.check_liveness()
    roster.mark_done("worker:0")  # done after being lost: only done
    assert (roster.done, roster.lost) == ({"worker:0"}, {"worker:2"})
    assert roster.check_liveness() == LivenessChange()  # no "back" for a finished worker
    assert roster.running() == ["worker:1"]
    assert roster.running(exclude="worker:1") == []
    assert roster.departed(including_lost=False) == {"worker:0"}
    assert roster.departed(including_lost=True) == {"worker:0", "worker:2"}
    assert roster.all_done_or_lost is False  # worker:1 is neither
    roster.heard_from("worker:1")
    run_for(roster, clock, LIVENESS_S + 1)
    assert roster.all_done_or_lost is True and roster.all_done is False
    roster.mark_done("worker:1")
    roster.mark_done("worker:2")
    assert roster.all_done is True


def test_no_workers_is_never_all_done() -> None:
    empty = WorkerRoster((), LIVENESS_S)
    assert not empty.all_done and not empty.all_done_or_lost


def test_a_second_process_is_refused_while_the_first_is_alive(
    roster: WorkerRoster, clock: FakeClock
) -> None:
    roster.claim("worker:0", "first", b"s1")
    roster.claim("worker:0", "first", b"s1-heartbeat")  # its heartbeat's channel: fine
    clock.now += 3.0
    with pytest.raises(IdentityInUse) as excinfo:
        roster.claim("worker:0", "second", b"s2")
    assert str(excinfo.value).startswith(
        "worker:0 is already running in another process (heard from 3.0 s ago)"
    )
    assert "TENSORFLEET_PREDECESSOR_DEAD=1" in str(excinfo.value)
    assert roster.holders == {"worker:0": "first"}
    roster.admit(b"s1")  # the holder's channels are served
    roster.admit(b"s1-heartbeat")
    roster.admit(b"never-said-hello")  # a channel without a claim: not the roster's to refuse


def test_a_lost_or_done_holder_lets_a_new_process_in(
    roster: WorkerRoster, clock: FakeClock
) -> None:
    roster.claim("worker:0", "first", b"s1")
    clock.now += LIVENESS_S + 1
    roster.check_liveness()
    roster.claim("worker:0", "second", b"s2")
    assert roster.holders["worker:0"] == "second" and roster.lost == set()
    with pytest.raises(IdentityInUse, match=r"worker:0's identity was taken over by another"):
        roster.admit(b"s1")
    roster.mark_done("worker:0")
    roster.claim("worker:0", "third", b"s3")  # a new process of a finished task: back
    assert roster.done == set() and roster.holders["worker:0"] == "third"


def test_takeover_takes_the_identity_of_a_live_holder_at_once(
    roster: WorkerRoster, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    roster.claim("worker:1", "old", b"old-channel")
    roster.claim("worker:1", "old", b"old-heartbeat")
    clock.now += 0.1
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps"):
        roster.claim("worker:1", "new", b"new-channel", takeover=True)
    assert roster.holders["worker:1"] == "new"
    assert "ps:0: worker:1: process new takes over from process old" in caplog.text
    for session in (b"old-channel", b"old-heartbeat"):
        with pytest.raises(IdentityInUse) as excinfo:
            roster.admit(session)
        assert str(excinfo.value) == (
            "worker:1's identity was taken over by another process (new; this is old): a "
            "restarted copy of this task runs now. Stop this process"
        )
    roster.admit(b"new-channel")
    # The old process cannot claim it back while the new one is alive.
    with pytest.raises(IdentityInUse, match="worker:1 is already running in another process"):
        roster.claim("worker:1", "old", b"old-channel")
    assert roster.holders["worker:1"] == "new"


def test_takeover_without_a_holder_is_an_ordinary_claim(
    roster: WorkerRoster, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps"):
        roster.claim("worker:2", "only", b"s", takeover=True)
        roster.claim("worker:2", "only", b"s", takeover=True)  # again, itself
    assert roster.holders == {"worker:2": "only"} and caplog.text == ""


@pytest.mark.parametrize("instance", [None, "", 7, "x" * 65])
def test_a_hello_without_a_valid_instance_claims_nothing_but_is_heard(
    roster: WorkerRoster, clock: FakeClock, instance: object
) -> None:
    roster.claim("worker:0", "holder", b"s1")
    clock.now += 1.0
    roster.claim("worker:0", instance, b"s2", takeover=True)
    assert roster.holders == {"worker:0": "holder"} and roster.heard["worker:0"] == clock.now
    roster.admit(b"s2")


def test_claims_of_unknown_tasks_are_ignored(roster: WorkerRoster) -> None:
    roster.claim("ps:0", "x", b"s")
    roster.claim(None, "x", b"s")
    assert roster.holders == {} and roster.heard == {}


def test_the_sessions_remembered_are_bounded(roster: WorkerRoster) -> None:
    roster.claim("worker:0", "old", b"first-session")
    for i in range(MAX_SESSIONS):
        roster.claim("worker:0", "old", f"session-{i}".encode())
    roster.claim("worker:0", "new", b"new", takeover=True)
    roster.admit(b"first-session")  # forgotten: no longer refused (nor remembered)
    with pytest.raises(IdentityInUse):
        roster.admit(f"session-{MAX_SESSIONS - 1}".encode())


def test_the_shards_own_stall_is_not_the_workers_silence(
    roster: WorkerRoster, clock: FakeClock
) -> None:
    """A ps stopped for longer than the liveness timeout reads its queue after SIGCONT one
    request at a time: the workers whose heartbeats it has not read yet are not lost, their
    silence counts from the first check after the gap; one that then stays silent is; a
    worker that left stays lost through the gap."""
    for task in WORKERS:
        roster.heard_from(task)
    roster.check_liveness()
    roster.mark_left("worker:2")
    assert roster.check_liveness() == LivenessChange(newly_lost=("worker:2",))
    clock.now += 40.0  # SIGSTOP of the ps: no check, no request read
    roster.heard_from("worker:0")  # the first queued request read after SIGCONT
    assert roster.check_liveness() == LivenessChange()  # worker:1 not blamed
    assert roster.lost == {"worker:2"}  # the left one stays lost
    run_for(roster, clock, 5.0)
    roster.heard_from("worker:1")  # its queued heartbeat, read a few seconds later
    run_for(roster, clock, LIVENESS_S - 5.0)
    assert roster.lost == {"worker:2"}
    run_for(roster, clock, 3.0)  # worker:0 silent past the timeout while the shard ran
    assert roster.lost == {"worker:0", "worker:2"}
