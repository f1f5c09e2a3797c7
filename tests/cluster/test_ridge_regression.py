"""Two workers and two ps shards train a ridge regression to the closed-form solution."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def _program():
    spec = importlib.util.spec_from_file_location("ridge_worker", PROGRAMS / "ridge_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
def test_two_workers_reach_the_closed_form_ridge_solution(tmp_path, python, encrypt):
    """Also with every task encrypting (what ``tensorfleet launch --encrypt`` sets): the ps
    servers, the workers' channels and heartbeats agree, or the run fails at hello."""
    program = _program()
    out = tmp_path / "weights.json"
    run = run_local_cluster(
        2,
        2,
        [python, str(PROGRAMS / "ridge_worker.py"), str(out), "300"],
        timeout_s=150,
        env={"TENSORFLEET_ENCRYPT": "1" if encrypt else "0"},
    )
    assert run.returncode == 0, str(run)
    assert not any("had to be stopped" in t or "SIGTERM" in t for t in run.output.of("launcher")), (
        f"the ps tasks should exit by themselves when training is over\n{run}"
    )
    placement = "\n".join(run.output.of("worker:0"))
    # The placement table: the partitioned weight is stored on both shards.
    assert any(
        line.split()[:2] == ["variable", "weight"] and "ps:0,ps:1" in line
        for line in placement.splitlines()
    ), str(run)

    closed_form = program.closed_form()
    trained = torch.tensor(json.loads(out.read_text())["weight"], dtype=torch.float64)
    error = (trained - closed_form).abs().max().item()
    assert error < 1e-3, f"max |trained - closed form| = {error:.2e}\n{run}"
