"""Persistent buffers (BatchNorm statistics, ``num_batches_tracked``, a user's buffer) are state
of the distributed model in every mode: trained with, combined, checkpointed, loaded strictly
into a fresh model; non-persistent buffers stay local."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys

import pytest
import torch
import torch.nn.functional as F

import tensorfleet as tfl

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
STEPS, WORKERS = 6, 2
BUFFERS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "seen")


def _program():
    spec = importlib.util.spec_from_file_location("bn_worker", PROGRAMS / "bn_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, mode: str, num_ps: int, steps: int = STEPS, out_name: str = "out"):
    """Train to global step ``steps`` with bn_worker.py on ``num_ps`` ps and WORKERS workers
    (from the newest checkpoint in ``tmp_path/checkpoints``, if any); returns the run, every
    worker's result and the checkpoint directory."""
    out, checkpoints = tmp_path / out_name, tmp_path / "checkpoints"
    command = [
        sys.executable, str(PROGRAMS / "bn_worker.py"), str(out), mode, str(steps), str(checkpoints),
    ]  # fmt: skip
    run = run_local_cluster(num_ps, WORKERS, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    results = [json.loads((tmp_path / f"{out_name}.{i}.json").read_text()) for i in range(WORKERS)]
    return run, results, checkpoints


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """The sync run on 2 ps, once per module: both tests of sync mode only read its result
    (each run starts 4 processes)."""
    return _run(tmp_path_factory.mktemp("sync"), "sync", 2)


@pytest.mark.parametrize(("mode", "num_ps"), [("async", 1), ("sync", 2), ("allreduce", 0)])
def test_buffers_are_trained_checkpointed_and_load_strictly(request, tmp_path, mode, num_ps):
    program = _program()
    if mode == "sync":
        run, results, checkpoints = request.getfixturevalue("sync_run")
    else:
        run, results, checkpoints = _run(tmp_path, mode, num_ps)
    chief = results[0]["trained"]
    fresh = program.make_model()
    loaded = tfl.load_checkpoint(checkpoints, fresh)  # strict: every key, nothing more
    assert "scratch" not in loaded, "a non-persistent buffer must not be saved"
    for name in BUFFERS:
        assert torch.equal(loaded[name], torch.tensor(chief[name])), f"{name}\n{run}"
        assert torch.equal(fresh.state_dict()[name], loaded[name])
    assert int(loaded["bn.num_batches_tracked"]) > 0 and float(loaded["seen"][0]) > 0
    assert not torch.equal(loaded["bn.running_mean"], torch.zeros(program.HIDDEN))
    for result in results:  # non-persistent: each worker counts only its own forward passes
        assert result["scratch"] <= STEPS + 1, str(run)
    if mode == "sync":  # every step combines both workers' pushes: counts as one process's
        assert int(loaded["bn.num_batches_tracked"]) == STEPS
        assert float(loaded["seen"][0]) == STEPS
    if mode != "allreduce":
        placement_lines = "\n".join(run.output.of("worker:0"))
        for name in BUFFERS:
            assert f"{name}  " in placement_lines and "(buffer)" in placement_lines, str(run)
    else:  # DDP broadcasts rank 0's buffers at the start of each forward pass
        for name in BUFFERS:
            assert results[1]["after_eval_forward"][name] == chief[name], f"{name}\n{run}"


def _sync_reference(program):
    """One process simulating sync mode exactly: every step, each worker's copy of the shared
    model runs forward and backward on its slice; the parameters take SGD with the mean
    gradient; floating buffers take the mean of the copies' buffers, integer ones the max.
    Also checks, step by step, that the mean of the slices' running_mean is what one process
    computes on the whole batch of the step (the identity behind the 'mean' policy)."""
    model = program.make_model()
    x, y = program.make_data(STEPS, WORKERS)
    for step in range(STEPS):
        replicas = []
        for worker in range(WORKERS):
            replica = copy.deepcopy(model)
            xb, yb = program.worker_batch(x, y, step, worker, WORKERS)
            F.cross_entropy(replica(xb), yb).backward()
            replicas.append(replica)
        whole = copy.deepcopy(model)
        start = step * WORKERS * program.BATCH
        whole(x[start : start + WORKERS * program.BATCH])
        with torch.no_grad():
            for name, param in model.named_parameters():
                grads = [dict(r.named_parameters())[name].grad for r in replicas]
                param -= 0.1 * torch.stack(grads).mean(0)
            for name, buffer in model.named_buffers():
                if name == "scratch":
                    continue
                values = torch.stack([dict(r.named_buffers())[name] for r in replicas])
                buffer.copy_(
                    values.float().mean(0) if buffer.is_floating_point() else values.amax(0)
                )
        assert torch.allclose(model.bn.running_mean, whole.bn.running_mean, atol=1e-6)
    return {k: v for k, v in model.state_dict().items() if k != "scratch"}


def test_sync_with_mean_buffers_matches_one_process_simulation(sync_run):
    program = _program()
    run, results, _ = sync_run
    reference = _sync_reference(program)
    chief = results[0]["trained"]
    for name, expected in reference.items():
        difference = (torch.tensor(chief[name], dtype=expected.dtype) - expected).abs().max()
        assert float(difference) < 1e-5, f"{name}: |distributed - reference| = {difference}\n{run}"


def test_a_second_run_of_the_same_command_resumes_the_buffers(tmp_path):
    """The checkpoint lists the buffers in its own order, the model in its own: the second
    run restores them and trains on (it was refused at its first pull: 'buffers [...] do
    not match this shard's [the same names in another order]')."""
    _, first, checkpoints = _run(tmp_path, "async", 1)
    run, second, _ = _run(tmp_path, "async", 1, steps=2 * STEPS, out_name="again")
    assert second[0]["global_step"] >= 2 * STEPS, str(run)
    before, after = first[0]["trained"], second[0]["trained"]
    assert after["seen"][0] > before["seen"][0], str(run)  # counted on from the checkpoint
    assert after["bn.num_batches_tracked"] > before["bn.num_batches_tracked"], str(run)
    loaded = tfl.load_checkpoint(checkpoints, _program().make_model())
    assert int(loaded["bn.num_batches_tracked"]) == after["bn.num_batches_tracked"], str(run)
