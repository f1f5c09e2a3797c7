"""A slow worker: sync with a backup worker goes on at the pace of the others and drops (and
counts) the straggler's stale gradients; bounded staleness never lets the gap exceed s,
checked from the ps's own record."""

from __future__ import annotations

import json
import sys

import pytest

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def _run(tmp_path, num_ps, num_workers, mode, steps, *options):
    out = tmp_path / "result.json"
    command = [
        sys.executable,
        str(PROGRAMS / "exact_worker.py"),
        str(out),
        mode,
        "sgd",
        str(steps),
        *options,
    ]
    run = run_local_cluster(num_ps, num_workers, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    per_worker = {}
    for i in range(num_workers):
        lines = [line for line in run.output.of(f"worker:{i}") if line.startswith('{"task"')]
        assert lines, f"worker:{i} printed no summary\n{run}"
        per_worker[f"worker:{i}"] = json.loads(lines[-1])
    return json.loads(out.read_text()), per_worker, run


def test_sync_with_a_backup_worker_does_not_wait_for_the_straggler(tmp_path):
    steps = 30
    result, workers, run = _run(
        tmp_path, 1, 3, "sync", steps, "--replicas", "2",
        "--step-seconds", "0.03", "--slow-worker", "2", "--slow-seconds", "0.12",
    )  # fmt: skip
    stats = result["stats"][0]
    assert result["global_step"] == steps, str(run)
    # The two fast workers made (nearly) every step; the straggler's late gradients were
    # dropped and counted by the ps, per worker.
    assert workers["worker:0"]["made_steps"] + workers["worker:1"]["made_steps"] >= steps - 2, (
        workers
    )
    # The chief read the ps's record when it finished; the straggler may push (and be
    # dropped) once more after that, which only its own count sees.
    assert 3 <= stats["dropped"].get("worker:2", 0) <= workers["worker:2"]["dropped"], (
        stats,
        workers,
    )
    assert stats["dropped"].get("worker:0", 0) + stats["dropped"].get("worker:1", 0) <= 2, stats


def test_plain_sync_waits_for_everyone(tmp_path):
    steps = 8
    result, workers, run = _run(
        tmp_path, 1, 3, "sync", steps, "--slow-worker", "2", "--slow-seconds", "0.1"
    )
    stats = result["stats"][0]
    assert result["global_step"] == steps, str(run)
    assert stats["dropped"] == {}, (
        "without backups no gradient is stale: everyone waits for everyone"
    )


@pytest.mark.parametrize("staleness", [0, 2])
def test_bounded_staleness_never_exceeds_s(tmp_path, staleness):
    steps = 40
    result, workers, run = _run(
        tmp_path, 2, 3, "async", steps, "--max-staleness", str(staleness),
        "--step-seconds", "0.01", "--slow-worker", "2", "--slow-seconds", "0.04",
    )  # fmt: skip
    for shard in result["stats"]:
        assert shard["max_staleness_seen"] is not None, shard
        assert shard["max_staleness_seen"] <= staleness, f"ps record: {shard}\n{run}"
    # The bound binds: with the straggler, the fast workers would otherwise run far ahead.
    assert max(shard["max_staleness_seen"] for shard in result["stats"]) == staleness, result[
        "stats"
    ]
