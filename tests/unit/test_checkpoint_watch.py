"""``tfl.checkpoints_iterator``: an evaluator program sees each new valid checkpoint of a run
as it appears (the newest when several appeared), passes over a corrupt one, and ends at the
run's last step or after its timeout without a new one. A real one-process session writes
the checkpoints, in a thread, while the evaluator reads them."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def _train(checkpoints: Path, steps: int, every: int, started: threading.Event) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    with tfl.TrainingSession(
        None, model, optimizer=tfl.optim.SGD(lr=0.1), checkpoint_dir=checkpoints,
        save_checkpoint_steps=every, progress_secs=None, hooks=[tfl.StopAtStep(last_step=steps)],
    ) as sess:  # fmt: skip
        started.set()
        while not sess.should_stop():
            sess.step(lambda: sess.model(torch.ones(4, 3)).pow(2).mean())


def test_an_evaluator_sees_the_runs_checkpoints_as_they_come_and_ends_at_its_last_step(
    tmp_path: Path,
):
    checkpoints, started = tmp_path / "checkpoints", threading.Event()
    trainer = threading.Thread(target=_train, args=(checkpoints, 60, 10, started), daemon=True)
    trainer.start()
    assert started.wait(30)
    seen = []
    for path in tfl.checkpoints_iterator(checkpoints, timeout_s=30, poll_s=0.05, last_step=60):
        state = tfl.load_checkpoint(path, nn.Linear(3, 1))
        seen.append((int(path.name.removeprefix("step-")), sorted(state)))
    trainer.join(30)
    steps = [step for step, _ in seen]
    assert steps == sorted(set(steps)) and steps[-1] == 60, steps  # new ones only, to the end
    assert all(names == ["bias", "weight"] for _, names in seen)


def test_the_newest_is_handed_out_a_corrupt_one_passed_over_and_a_quiet_run_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="tensorfleet.session")
    checkpoints, started = tmp_path / "checkpoints", threading.Event()
    _train(checkpoints, 30, 10, started)  # steps 10, 20, 30 already there
    newest = checkpoints / "step-00000030"
    shard = next(newest.glob("shard-*"))
    shard.write_bytes(b"torn" + shard.read_bytes()[4:])
    seen = list(tfl.checkpoints_iterator(checkpoints, timeout_s=0.3, poll_s=0.05))
    assert [p.name for p in seen] == ["step-00000020"]  # 30 is corrupt, 10 is older than 20
    assert "step-00000030" in caplog.text and "passing over it" in caplog.text
    assert "no new checkpoint" in caplog.text
    with pytest.raises(ConfigError, match="timeout_s and poll_s must be > 0"):
        next(tfl.checkpoints_iterator(checkpoints, timeout_s=0))
