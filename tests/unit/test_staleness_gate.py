"""StalenessGate: stale-synchronous parallel clocks. The fastest live worker is never more than
``max_staleness`` pushes ahead of the slowest; late joiners start at the slowest clock; a
finished worker holds nobody back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorfleet.ps.staleness_gate import StalenessGate

WORKERS = ("worker:0", "worker:1", "worker:2")


def test_negative_max_staleness_is_refused() -> None:
    with pytest.raises(ValueError, match="max_staleness must be >= 0, got -1"):
        StalenessGate(-1)


def test_zero_staleness_moves_in_lockstep() -> None:
    gate = StalenessGate(0)
    gate.join("worker:0")
    gate.join("worker:1")
    assert gate.may_apply("worker:0")
    gate.record("worker:0")
    assert not gate.may_apply("worker:0")  # one ahead of worker:1
    assert gate.may_apply("worker:1")
    gate.record("worker:1")
    assert gate.may_apply("worker:0")
    assert gate.clocks == {"worker:0": 1, "worker:1": 1}
    assert gate.max_gap_seen == 0


def test_a_worker_may_run_max_staleness_ahead_and_no_further() -> None:
    gate = StalenessGate(2)
    gate.join("worker:0")
    gate.join("worker:1")
    for expected_gap in (0, 1, 2):
        assert gate.gap("worker:0") == expected_gap
        assert gate.may_apply("worker:0")
        gate.record("worker:0")
    assert gate.gap("worker:0") == 3
    assert not gate.may_apply("worker:0")
    assert gate.slowest() == ["worker:1"]
    assert gate.max_gap_seen == 2
    gate.record("worker:1")
    assert gate.may_apply("worker:0")


def test_a_late_joiner_starts_at_the_slowest_live_clock() -> None:
    gate = StalenessGate(1)
    gate.join("worker:0")
    gate.join("worker:1")
    for _ in range(3):
        gate.record("worker:0")
    for _ in range(2):
        gate.record("worker:1")
    gate.join("worker:2")
    assert gate.clocks == {"worker:0": 3, "worker:1": 2, "worker:2": 2}
    gate.join("worker:2")  # joining again changes nothing
    assert gate.clocks["worker:2"] == 2
    assert gate.slowest() == ["worker:1", "worker:2"]


def test_the_first_worker_starts_at_zero_and_gap_joins_an_unknown_worker() -> None:
    gate = StalenessGate(1)
    assert gate.slowest() == []
    assert gate.gap("worker:1") == 0
    assert gate.clocks == {"worker:1": 0}


def test_a_worker_that_leaves_no_longer_holds_the_others_back() -> None:
    gate = StalenessGate(0)
    gate.join("worker:0")
    gate.join("worker:1")
    gate.record("worker:0")
    assert not gate.may_apply("worker:0")
    gate.leave("worker:1")
    gate.leave("worker:1")  # leaving twice is harmless
    assert gate.may_apply("worker:0")
    assert gate.clocks == {"worker:0": 1}


@given(
    st.integers(0, 3),
    st.lists(st.sampled_from([*WORKERS, "leave:worker:2"]), max_size=60),
)
def test_a_gated_schedule_never_exceeds_max_staleness(max_staleness: int, events: list) -> None:
    """Drive the gate as the service does (held pushes released oldest first) with any
    arrival order: no applied push is ever more than max_staleness ahead, and max_gap_seen
    says so."""
    gate = StalenessGate(max_staleness)
    held: list[str] = []
    left: set[str] = set()

    def release() -> None:
        progress = True
        while progress:
            progress = False
            for index, task in enumerate(held):
                if gate.may_apply(task):
                    del held[index]
                    assert gate.gap(task) <= max_staleness
                    gate.record(task)
                    progress = True
                    break

    for event in events:
        if event.startswith("leave:"):
            task = event.removeprefix("leave:")
            if task not in left:
                left.add(task)
                held = [t for t in held if t != task]
                gate.leave(task)
        elif event not in left and event not in held:  # one push in flight per worker
            gate.join(event)
            held.append(event)
        release()
        assert gate.max_gap_seen <= max_staleness
        if gate.clocks:
            assert max(gate.clocks.values()) - min(gate.clocks.values()) <= max_staleness + 1
    for task in held:  # whatever is still held, the gate holds for a reason
        assert not gate.may_apply(task)
