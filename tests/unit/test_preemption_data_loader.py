"""A SIGTERM sent to a training process's whole group (Slurm, torchrun, ``tensorfleet
launch``) also ends its DataLoader's workers; the session still takes it for a preemption:
the step in progress completes, the chief saves a checkpoint at the step of the signal and
the process exits with status 143, whether the workers' deaths are noticed inside the step
(torch's SIGCHLD handler) or by the loop's next batch. A second run resumes there.

Each case runs a one-process session in a child process of its own process group, which
signals that whole group itself at global step 5."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

PROGRAM = r"""
import json, os, subprocess, sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import tensorfleet as tfl

checkpoints, where, out = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = nn.Linear(4, 1)
data = TensorDataset(torch.randn(4096, 4), torch.randn(4096, 1))
loader = DataLoader(data, batch_size=8, num_workers=2, persistent_workers=True)


def the_group_gets_sigterm():
    # This process leads its own group (started in a session of its own): that group only.
    # From another process, as a launcher or Slurm sends it (a DataLoader worker exits
    # quietly on a SIGTERM from its parent, and dies of one from anyone else).
    assert os.getpgid(0) == os.getpid() > 1
    sender = f"import os, signal; os.killpg({os.getpid()}, signal.SIGTERM)"
    subprocess.run([sys.executable, "-c", sender], check=False)
    time.sleep(0.5)  # the workers are dead by now: their SIGCHLD comes meanwhile


with tfl.TrainingSession(
    None, model, optimizer=tfl.optim.SGD(lr=0.01), checkpoint_dir=checkpoints, progress_secs=None
) as sess:
    json.dump({"started_at": sess.global_step}, open(out, "w"))
    batches = iter(loader)
    while not sess.should_stop() and sess.global_step < 40:
        if where == "loop" and sess.global_step == 5:
            the_group_gets_sigterm()
        x, y = next(batches)

        def loss(x=x, y=y):
            if where == "step" and sess.global_step == 5:
                the_group_gets_sigterm()
            return nn.functional.mse_loss(model(x), y)

        sess.step(loss)
"""


def _run(tmp_path: Path, where: str, out: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path / "ckpt"), where, str(tmp_path / out)],
        capture_output=True,
        text=True,
        timeout=90,
        start_new_session=True,  # its own process group, which it signals
        check=False,
    )


@pytest.mark.parametrize("where", ["step", "loop"])
def test_a_sigterm_to_the_group_with_a_data_loader_is_a_preemption(tmp_path: Path, where: str):
    first = _run(tmp_path, where, "first.json")
    output = first.stdout + first.stderr
    assert first.returncode == 143, output
    assert "preempted (SIGTERM) at global step" in output, output
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))
    assert saved, output
    if where == "loop":
        assert "handled as the preemption" in output, output
    second = _run(tmp_path, "none", "second.json")
    assert second.returncode == 0, second.stdout + second.stderr
    resumed_at = json.loads((tmp_path / "second.json").read_text())["started_at"]
    assert resumed_at == int(saved[-1].removeprefix("step-")) >= 5, (saved, resumed_at)
