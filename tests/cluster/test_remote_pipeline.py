"""A pipeline across two tasks (two processes over gloo): the same outputs, gradients and
parameters after 5 steps as the unsplit model; a stage that dies is named by the other one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tensorfleet.launch.ports import free_port

PROGRAM = Path(__file__).parent / "programs" / "pipeline_stage.py"
sys.path.insert(0, str(PROGRAM.parent))
from pipeline_stage import make_batches, make_model  # noqa: E402

pytestmark = pytest.mark.cluster


def run_stages(tmp_path: Path, *extra: list[str], timeout: float = 60) -> list[tuple[int, str]]:
    """Start both stages, wait for both (a deadline each), return (status, output) per stage."""
    rendezvous = f"127.0.0.1:{free_port()}"
    procs = []
    try:
        for rank in (0, 1):
            argv = [
                sys.executable,
                str(PROGRAM),
                "--rank",
                str(rank),
                "--rendezvous",
                rendezvous,
                "--out",
                str(tmp_path / f"stage{rank}.safetensors"),
                *extra[rank],
            ]
            procs.append(
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b"])  # GPipe: same code path, tested in one task
def test_two_stage_pipeline_across_tasks_matches_the_unsplit_model(tmp_path, schedule):
    results = run_stages(tmp_path, ["--schedule", schedule], ["--schedule", schedule])
    report = "\n".join(f"--- stage {i} (exit {rc}):\n{out}" for i, (rc, out) in enumerate(results))
    assert all(rc == 0 for rc, _ in results), report
    got = {
        **load_file(tmp_path / "stage0.safetensors"),
        **load_file(tmp_path / "stage1.safetensors"),
    }

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(make_batches(5, 32)):
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        assert (got[f"outputs/{step}"] - out.detach()).abs().max() < 1e-5, step
        assert abs(got[f"loss/{step}"].item() - loss.item()) < 1e-5, step
        for name, p in model.named_parameters():
            assert (got[f"grad/{step}/{name}"] - p.grad).abs().max() < 1e-5, (step, name)
        opt.step()
    for name, p in model.named_parameters():
        assert (got[f"param/{name}"] - p.detach()).abs().max() < 1e-5, name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dying", [0, 1])
def test_a_stage_that_dies_is_named_by_the_other(tmp_path, dying):
    extra = [[], []]
    extra[dying] = ["--die-at-step", "2"]
    results = run_stages(tmp_path, *extra)
    survivor = 1 - dying
    rc, out = results[survivor]
    report = "\n".join(f"--- stage {i} (exit {r}):\n{o}" for i, (r, o) in enumerate(results))
    assert results[dying][0] == 3, report
    assert rc == 4, report
    assert f"PIPELINE FAILED: stage {survivor} (worker:{survivor}) of 2" in out, report
    assert "the pipeline broke in step 2" in out, report
    assert f"stage {dying} (worker:{dying})" in out, report


@pytest.mark.timeout(120)
def test_the_leader_updates_the_whole_model_and_sends_each_stage_its_values(tmp_path):
    """One pipeline as one ps replica: gradients gathered to stage 0, values sent back."""
    results = run_stages(tmp_path, ["--exchange"], ["--exchange"])
    report = "\n".join(f"--- stage {i} (exit {rc}):\n{out}" for i, (rc, out) in enumerate(results))
    assert all(rc == 0 for rc, _ in results), report
    leader = load_file(tmp_path / "stage0.safetensors")
    follower = load_file(tmp_path / "stage1.safetensors")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in make_batches(5, 32):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for name, p in model.named_parameters():
        assert (leader[f"leader/{name}"] - p.detach()).abs().max() < 1e-5, name
        if name.split(".")[0] in ("4", "6"):  # stage 1's layers: values sent back
            assert (follower[f"param/{name}"] - p.detach()).abs().max() < 1e-5, name
