"""Async training with the gradients pushed in buckets during the backward pass and the last
reply prefetched, on a real local cluster (1 ps + 2 workers): it converges, checkpoints, ends
cleanly, and the timelines of a worker and of the ps show the pushes overlapping the backward
pass and the ps applying bucket after bucket."""

from __future__ import annotations

import json
import sys

import pytest

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
LAST_STEP = 200


def test_async_training_with_buckets_and_prefetch_converges_and_ends_cleanly(tmp_path) -> None:
    result, timeline = tmp_path / "result.json", tmp_path / "trace.json"
    command = [
        sys.executable,
        str(PROGRAMS / "overlap_worker.py"),
        str(result),
        str(LAST_STEP),
        str(tmp_path / "checkpoints"),
        str(timeline),
    ]
    ps_command = [sys.executable, "-m", "tensorfleet", "server", "--timeline", str(timeline)]
    run = run_local_cluster(1, 2, command, timeout_s=200, ps_command=ps_command)
    assert run.returncode == 0, str(run)
    chief = json.loads(result.read_text())
    assert chief["accuracy"] >= 0.9, (chief, str(run))
    assert chief["global_step"] >= LAST_STEP and chief["dropped"] == 0, (chief, str(run))
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints and checkpoints[-1] >= f"step-{LAST_STEP:08d}", checkpoints
    for worker in ("worker-0", "worker-1"):
        spans = [
            e
            for e in json.loads((tmp_path / f"trace.{worker}.json").read_text())["traceEvents"]
            if e["ph"] == "X"
        ]
        backwards = [e for e in spans if e["name"] == "backward"]
        pushes = [e for e in spans if e["name"] == "push"]
        overlapped = [
            b for b in backwards if any(b["ts"] <= p["ts"] < b["ts"] + b["dur"] for p in pushes)
        ]
        # With prefetch a bucket waits during the backward for the previous step's last reply
        # (one request in flight per shard), which a step this small may outrun; the first
        # step has nothing in flight, so its first bucket always goes during its backward.
        assert overlapped and overlapped[0] is backwards[0], (worker, len(overlapped))
    ps = json.loads((tmp_path / "trace.ps-0.json").read_text())["traceEvents"]
    applied = [e for e in ps if e.get("name") == "apply"]
    buckets = [e for e in applied if "variables" in e.get("args", {})]  # parts of the variables
    assert len(applied) >= LAST_STEP and buckets, (len(applied), len(buckets))
