"""A storm's worker recoveries are split by whether the ps was out when their clock started
(``benchmarks/storm_outages.py``): a SIGSTOP of the ps for its stop seconds, a kill or SIGTERM
until its recovery (to the end when it never recovered)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from storm_outages import PS_OUT, PS_UP, ps_outages, split_table, split_worker_recoveries  # noqa: E402


def fault(task, kind, at_s, recovered_s, resumed_at_s=None):
    return {
        "task": task,
        "kind": kind,
        "at_s": at_s,
        "recovered_s": recovered_s,
        "resumed_at_s": resumed_at_s,
    }


FAULTS = [
    fault("ps:0", "stop", 10.0, 0.2, resumed_at_s=25.0),  # out 10-25 s
    fault("worker:0", "term", 20.0, 5.4),  # 10 s into the ps's stop
    fault("worker:1", "kill", 40.0, 0.6),  # the ps up
    fault("ps:0", "kill", 50.0, 0.5),  # out 50-50.5 s
    fault("worker:2", "stop", 35.0, 0.4, resumed_at_s=50.2),  # clock from SIGCONT: in it
    fault("worker:1", "stop", 60.0, 0.3, resumed_at_s=75.0),  # the ps up at the SIGCONT
    fault("worker:0", "kill", 80.0, None),  # never recovered: not a recovery
    fault("ps:0", "term", 90.0, None),  # never recovered: out to the end
    fault("worker:2", "term", 95.0, 7.0),
]


def test_the_ps_outages_are_its_stops_and_its_restarts() -> None:
    assert ps_outages(FAULTS, stop_seconds=15.0) == [
        (10.0, 25.0),
        (50.0, 50.5),
        (90.0, float("inf")),
    ]


def test_worker_recoveries_are_split_by_the_ps_outage_their_clock_started_in() -> None:
    groups = split_worker_recoveries(FAULTS, stop_seconds=15.0)
    assert groups == {
        ("term", PS_OUT): [5.4, 7.0],
        ("kill", PS_UP): [0.6],
        ("stop", PS_OUT): [0.4],
        ("stop", PS_UP): [0.3],
    }
    table = split_table(FAULTS, stop_seconds=15.0)
    assert table[2] == f"| kill | {PS_UP} | 1 | 0.6 | 0.6 | 0.6 |"
    assert f"| term | {PS_OUT} | 2 | 6.2 | 6.9 | 7.0 |" in table


def test_the_command_line_prints_each_storm_and_refuses_other_results(tmp_path) -> None:
    storm = tmp_path / "storm.json"
    storm.write_text(json.dumps({"mode": "storm", "seed": 3, "stop_seconds": 15, "faults": FAULTS}))
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "storm_outages.py"), str(storm)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "storm.json (seed 3):" in run.stdout and f"| term | {PS_OUT} | 2 |" in run.stdout
    other = tmp_path / "kills.json"
    other.write_text(json.dumps({"mode": "kills"}))
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "storm_outages.py"), str(other)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "is not a storm's result (its mode is 'kills')" in run.stderr


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_the_committed_storms_split(seed) -> None:
    result = json.loads((BENCHMARKS / "results" / f"chaos_storm_10min_seed{seed}.json").read_text())
    groups = split_worker_recoveries(result["faults"], result["stop_seconds"])
    recovered = [
        f
        for f in result["faults"]
        if f["task"].startswith("worker") and f["recovered_s"] is not None
    ]
    assert sum(len(v) for v in groups.values()) == len(recovered)


def test_a_stopped_ps_the_launcher_replaced_is_out_until_its_recovery() -> None:
    """A SIGSTOP of the ps that the launcher ended by replacing the ps (``replaced``) is an
    outage as a kill is, from the stop to the replacement's first step, not the whole stop."""
    replaced = {**fault("ps:0", "stop", 10.0, 3.1, resumed_at_s=25.0), "replaced": True}
    faults = [
        replaced,
        fault("worker:0", "term", 12.0, 2.5),  # inside the 3.1 s outage
        fault("worker:1", "term", 20.0, 0.8),  # after it, though the stop would last to 25 s
    ]
    assert ps_outages(faults, stop_seconds=15.0) == [(10.0, 13.1)]
    assert split_worker_recoveries(faults, stop_seconds=15.0) == {
        ("term", PS_OUT): [2.5],
        ("term", PS_UP): [0.8],
    }
