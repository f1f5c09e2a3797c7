"""Every update mode with its model on a device: the cpu case runs everywhere, the cuda case
on a machine with a CUDA GPU (both workers of the cluster on the same GPU, sharing it: the
all-reduce group then runs over gloo). The ps keeps the variables, sparse rows and buffers
in host memory; what comes back to the workers lands on their device.

Deterministic modes (sync, all-reduce, in-graph replicas, pipeline stages, a sparse=True
embedding, a tfl.EmbeddingTable) must give the parameters of one process on the CPU with
the concatenated batch within 1e-4 after a few steps; BatchNorm's running statistics (which
the ps combines, so no one process gives them) must equal the CPU cluster's within 1e-4 on
the GPU and have moved on the CPU; async, backup workers and bounded staleness depend on
timing: they must reach the last step with finite parameters that moved."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(200)]
STEPS, WORKERS = 6, 2
DETERMINISTIC = {"sync", "allreduce", "replicas", "stages", "sparse", "table"}
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]
#: The CPU cluster's final state per case, for the GPU run of the same case.
_cpu_runs: dict[str, dict] = {}


def _program():
    path = PROGRAMS / "device_mode_worker.py"
    sys.path.insert(0, str(PROGRAMS))
    spec = importlib.util.spec_from_file_location("device_mode_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cluster(tmp_path: Path, case: str, device: str) -> dict:
    out = tmp_path / f"{case}-{device}.json"
    command = [sys.executable, str(PROGRAMS / "device_mode_worker.py"), str(out), case, device,
               str(STEPS)]  # fmt: skip
    run = run_local_cluster(0 if case == "allreduce" else 1, WORKERS, command, timeout_s=170)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    # async modes may pass the last step by a step or two (the other worker's push)
    assert result["global_step"] == STEPS or (
        case not in DETERMINISTIC and STEPS <= result["global_step"] <= STEPS + WORKERS
    ), str(run)
    assert result["devices"] == [device], str(run)  # the exchange left the model on its device
    result["run"] = str(run)
    return result


def _one_process_reference(program, case: str) -> dict[str, torch.Tensor]:
    """One process on the CPU (a TrainingSession without a cluster), the workers' batches of
    each step concatenated."""
    import tensorfleet as tfl

    model = program.make_model(case)
    x, y = program.make_data(STEPS, WORKERS)
    with tfl.TrainingSession(None, model, optimizer=tfl.optim.SGD(lr=0.1)) as sess:
        for step in range(STEPS):
            start = step * WORKERS * program.BATCH
            xb, yb = (
                x[start : start + WORKERS * program.BATCH],
                y[start : start + WORKERS * program.BATCH],
            )
            sess.step(lambda xb=xb, yb=yb: F.cross_entropy(sess.model(xb), yb))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if case == "table":
            model.eval()
            with torch.no_grad():
                state["embedding.rows"] = model.embedding(torch.arange(program.ROWS))
    return state


def _difference(result: dict, reference: dict[str, torch.Tensor]) -> float:
    assert sorted(result["state"]) == sorted(reference), (
        sorted(result["state"]),
        sorted(reference),
    )
    return max(
        (torch.tensor(result["state"][k], dtype=torch.float64) - reference[k].double())
        .abs()
        .max()
        .item()
        for k in reference
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case",
    [
        "async",
        "sync",
        "backup",
        "staleness",
        "allreduce",
        "replicas",
        "stages",
        "sparse",
        "table",
        "bn",
    ],
)
def test_mode_on_device(tmp_path: Path, case: str, device: str) -> None:
    program = _program()
    result = _cluster(tmp_path, case, device)
    if device == "cpu":
        _cpu_runs[case] = result
    if case in DETERMINISTIC:
        difference = _difference(result, _one_process_reference(program, case))
        assert difference < 1e-4, (
            f"max |{device} cluster - one process| = {difference:.2e}\n{result['run']}"
        )
        return
    initial = {k: v.double() for k, v in program.make_model(case).state_dict().items()}
    for name, values in result["state"].items():
        assert torch.isfinite(torch.tensor(values)).all(), (name, result["run"])
    assert _difference(result, initial) > 1e-3, "training moved nothing\n" + result["run"]
    if case == "bn":
        assert result["state"]["1.num_batches_tracked"] != 0, result["run"]
        if device == "cuda":  # the same cluster on the CPU: the buffers travel alike
            cpu = _cpu_runs.get(case) or _cluster(tmp_path, case, "cpu")
            reference = {k: torch.tensor(v) for k, v in cpu["state"].items()}
            difference = _difference(result, reference)
            assert difference < 1e-4, f"max |cuda - cpu| = {difference:.2e}\n{result['run']}"
