"""A pipeline across processes driven by its leader's training loop: the leader calls the
pipeline like a module, the other stages serve; the same outputs, gradients and parameters
after 5 steps as the unsplit model; a stage that dies is named by the leader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tensorfleet.launch.ports import free_port

PROGRAM = Path(__file__).parent / "programs" / "driven_stage.py"
sys.path.insert(0, str(PROGRAM.parent))
from pipeline_stage import make_batches, make_model  # noqa: E402

pytestmark = pytest.mark.cluster


def run(tmp_path: Path, world: int, extra: dict[int, list[str]] | None = None):
    rendezvous = f"127.0.0.1:{free_port()}"
    procs = []
    try:
        for rank in range(world):
            argv = [
                sys.executable,
                str(PROGRAM),
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--rendezvous",
                rendezvous,
                "--out",
                str(tmp_path / f"rank{rank}.safetensors"),
                *(extra or {}).get(rank, []),
            ]
            procs.append(
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        return [_finish(p) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=90)
    return proc.returncode, out


def report(results) -> str:
    return "\n".join(f"--- rank {i} (exit {rc}):\n{out}" for i, (rc, out) in enumerate(results))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_leader_driven_pipeline_matches_the_unsplit_model(tmp_path, world):
    results = run(tmp_path, world)
    assert all(rc == 0 for rc, _ in results), report(results)
    assert "served 5 steps" in results[-1][1], report(results)
    leader = load_file(tmp_path / "rank0.safetensors")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(make_batches(5, 32)):
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out, y).backward()
        assert (leader[f"outputs/{step}"] - out.detach()).abs().max() < 1e-5, step
        for name, p in model.named_parameters():
            assert (leader[f"grad/{step}/{name}"] - p.grad).abs().max() < 1e-5, (step, name)
        opt.step()
    for rank in range(world):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        # every stage's own layers hold the leader's values
        own = {2: {0: ("0", "2"), 1: ("4", "6")}, 3: {0: ("0",), 1: ("2",), 2: ("4", "6")}}
        for name, p in model.named_parameters():
            if name.split(".")[0] in own[world][rank]:
                assert (got[f"param/{name}"] - p.detach()).abs().max() < 1e-5, (rank, name)


@pytest.mark.timeout(120)
def test_a_dying_stage_is_named_by_the_leader(tmp_path):
    results = run(tmp_path, 2, {1: ["--die-at-step", "2"]})
    assert results[1][0] == 3, report(results)
    assert results[0][0] == 4, report(results)
    assert "PIPELINE FAILED: stage 0 (worker:0) failed" in results[0][1], report(results)
    assert "stage 1 (worker:1) probably stopped or died" in results[0][1], report(results)
