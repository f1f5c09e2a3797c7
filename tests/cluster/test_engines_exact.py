"""Exactness of the device engines in sync mode through a real cluster: 2 workers each with 2
in-graph replicas, 2 workers each running a 2-stage pipeline, and 2 pipelines of 2 stages
across 4 worker tasks must all give the parameters of one process with the concatenated
batch (within 1e-5 after 20 steps), for SGD and Adam."""

from __future__ import annotations

import json
import sys

import pytest

from tensorfleet import environment

from .conftest import PROGRAMS, run_local_cluster
from .test_sync_and_allreduce import _max_difference, _one_process_reference, _program

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
STEPS = 20  # the reference of test_sync_and_allreduce trains 20 steps on its data


@pytest.mark.parametrize(
    ("engine", "workers", "env", "rule"),
    [
        ("replicas", 2, {}, "adam"),
        ("local_pipeline", 2, {}, "sgd"),
        ("task_pipeline", 4, {environment.PIPELINE_STAGES_VAR: "2"}, "adam"),
    ],
)
def test_engines_in_sync_mode_equal_one_process(tmp_path, engine, workers, env, rule):
    out = tmp_path / "result.json"
    command = [sys.executable, str(PROGRAMS / "exact_engine_worker.py"), str(out), engine, rule,
               str(STEPS)]  # fmt: skip
    run = run_local_cluster(1, workers, command, timeout_s=200, env=env)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    assert result["global_step"] == STEPS, str(run)
    reference, _ = _one_process_reference(_program(), rule, 2)
    difference = _max_difference(result["params"], reference)
    assert difference < 1e-5, f"max |engine - one process| = {difference:.2e}\n{run}"
