"""Several models on one cluster: two different models train at once on one shared ps task,
each in its own namespace, and each ends with exactly the parameters of its own one-process
run; their checkpoints do not mix, and the ps exits by itself once both are done."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from tensorfleet.session.checkpoints import CheckpointDirectory

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
STEPS = 12


def _program():
    spec = importlib.util.spec_from_file_location("two_models", PROGRAMS / "two_models_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_process_reference(program, name: str) -> dict[str, torch.Tensor]:
    """The model alone in one process, batch 2*b (sync mode averages its 2 workers' b)."""
    workers, hidden, lr, seed = program.MODELS[name]
    model = program.make_model(hidden)
    x, y = program.make_data(STEPS, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    batch = len(workers) * program.BATCH
    for step in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(
            model(x[step * batch : (step + 1) * batch]), y[step * batch : (step + 1) * batch]
        ).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_two_models_train_at_once_on_one_ps_each_as_alone(tmp_path, python):
    program = _program()
    checkpoints = tmp_path / "checkpoints"
    run = run_local_cluster(
        1,
        4,
        [
            python,
            str(PROGRAMS / "two_models_worker.py"),
            str(tmp_path),
            str(checkpoints),
            str(STEPS),
        ],
        timeout_s=200,
    )
    assert run.returncode == 0, str(run)
    assert any("ps:0 ended: exited 0" in line for line in run.output.of("launcher")), str(run)
    assert not any("had to be stopped" in t or "SIGTERM" in t for t in run.output.of("launcher")), (
        f"the ps should exit by itself once both models are done\n{run}"
    )
    for name, chief in (("narrow", "worker:0"), ("wide", "worker:2")):
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert result["task"] == chief, result["task"]
        assert result["global_step"] == STEPS, f"{name}: {result['global_step']}\n{run}"
        reference = _one_process_reference(program, name)
        assert {k: list(v.shape) for k, v in reference.items()} == {
            k: list(torch.tensor(v).shape) for k, v in result["params"].items()
        }
        error = max(
            (torch.tensor(result["params"][k]) - reference[k]).abs().max().item() for k in reference
        )
        assert error < 1e-5, f"{name}: max |cluster - one process| = {error:.2e}\n{run}"
        # log_placement names the namespace; each model's checkpoints are its own.
        assert any(f"placement of model '{name}'" in line for line in run.output.of(chief)), str(
            run
        )
        newest = CheckpointDirectory(checkpoints / name).newest_valid()
        assert newest is not None and newest.global_step == STEPS, str(run)
        assert newest.manifest["model"] == name and newest.manifest["task"] == chief
        assert {p["param"] for p in newest.manifest["placement"].values()} == set(reference)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["narrow", "wide"]
