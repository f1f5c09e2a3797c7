"""Exactness of synchronous and all-reduce training: n workers with batch b must produce the
parameters of one process with batch n*b (within 1e-5 after 20 steps), for SGD and Adam."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
STEPS = 20


def _program():
    spec = importlib.util.spec_from_file_location("exact_worker", PROGRAMS / "exact_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_process_reference(
    program, rule_name: str, num_workers: int, clip: float | None = None, ema: float | None = None
):
    """One process, batch n*b: the concatenation of the workers' batches of each step."""
    model = program.make_model()
    x, y = program.make_data(STEPS, num_workers)
    rule = program.rule(rule_name)
    optimizer = rule.build(list(model.parameters()))
    averages = {k: v.detach().clone() for k, v in model.named_parameters()}
    for step in range(STEPS):
        start = step * num_workers * program.BATCH
        xb, yb = (
            x[start : start + num_workers * program.BATCH],
            y[start : start + num_workers * program.BATCH],
        )
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if ema is not None:
            for k, v in model.named_parameters():
                averages[k].lerp_(v.detach(), 1 - ema)
    return {k: v.detach() for k, v in model.state_dict().items()}, averages


def _max_difference(result: dict, reference: dict) -> float:
    return max((torch.tensor(result[k]) - reference[k]).abs().max().item() for k in reference)


@pytest.mark.parametrize(
    ("mode", "num_ps", "rule"),
    [("sync", 2, "sgd"), ("sync", 2, "adam"), ("allreduce", 0, "sgd"), ("allreduce", 0, "adam")],
)
def test_n_workers_of_batch_b_equal_one_process_of_batch_nb(tmp_path, mode, num_ps, rule):
    program = _program()
    out = tmp_path / "result.json"
    command = [sys.executable, str(PROGRAMS / "exact_worker.py"), str(out), mode, rule, str(STEPS)]
    run = run_local_cluster(num_ps, 3, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    assert result["global_step"] == STEPS, str(run)
    reference, _ = _one_process_reference(program, rule, 3)
    difference = _max_difference(result["params"], reference)
    assert difference < 1e-5, f"max |distributed - one process| = {difference:.2e}\n{run}"


def test_sync_clips_the_aggregated_gradient_and_keeps_a_moving_average(tmp_path):
    program = _program()
    out = tmp_path / "result.json"
    command = [
        sys.executable,
        str(PROGRAMS / "exact_worker.py"),
        str(out),
        "sync",
        "sgd",
        str(STEPS),
        "--clip",
        "0.05",
        "--ema",
        "0.9",
    ]
    run = run_local_cluster(1, 2, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    reference, averages = _one_process_reference(program, "sgd", 2, clip=0.05, ema=0.9)
    assert _max_difference(result["params"], reference) < 1e-5, str(run)
    unclipped, _ = _one_process_reference(program, "sgd", 2)
    assert _max_difference(result["params"], unclipped) > 1e-3, (
        "the clip must have changed the result"
    )
    assert _max_difference(result["ema"], averages) < 1e-5, str(run)
