"""Checkpoints of a one-process run (no cluster): a run cut in two by a checkpoint and a
restart ends bit-for-bit where the uninterrupted run ends (parameters, optimizer state,
moving average, global step and the place in the data all come back)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tensorfleet.datasets.batches import BatchStream
from tensorfleet.errors import CheckpointError, ConfigTypeError
from tensorfleet.launch.cli import main
from tensorfleet.ps.update_rules import Adam
from tensorfleet.session.checkpoints import load_checkpoint
from tensorfleet.session.hooks import StopAtStep
from tensorfleet.session.training_session import TrainingSession

pytestmark = pytest.mark.timeout(60)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator)


def _train(
    last_step: int, checkpoint_dir: Path | None
) -> tuple[nn.Module, TrainingSession, int, dict[str, torch.Tensor]]:
    """Train to ``last_step``; return the model, the session, the steps this run took and
    the moving average at the end (read inside the ``with`` block, where the session is
    open)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = _data()
    batches = BatchStream(x, y, 8, seed=5)
    session = TrainingSession(
        None,
        model,
        Adam(lr=0.05),
        hooks=[StopAtStep(last_step=last_step)],
        ema_decay=0.9,
        checkpoint_dir=checkpoint_dir,
        save_checkpoint_steps=100 if checkpoint_dir else None,
        data=batches,
    )
    steps = 0
    with session as sess:
        while not sess.should_stop():
            images, labels = next(batches)
            sess.step(
                lambda images=images, labels=labels: nn.functional.cross_entropy(
                    model(images), labels
                )
            )
            steps += 1
        average = sess.moving_average()
    return model, session, steps, average


def test_a_run_resumed_from_its_checkpoint_ends_exactly_where_the_uninterrupted_one_does(
    tmp_path: Path,
) -> None:
    straight, straight_session, _, straight_average = _train(12, None)
    _train(5, tmp_path)  # the first half; its final checkpoint is at step 5 (an epoch is 8)
    resumed, resumed_session, steps, resumed_average = _train(12, tmp_path)
    assert steps == 7 and resumed_session.last_checkpoint == tmp_path / "step-00000012"
    assert resumed_session.global_step == straight_session.global_step == 12
    for (name, a), (_, b) in zip(
        straight.state_dict().items(), resumed.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert straight_average.keys() == resumed_average.keys()
    for name, average in straight_average.items():
        assert torch.equal(average, resumed_average[name]), name


def test_without_the_optimizer_state_or_the_data_position_the_result_differs(
    tmp_path: Path,
) -> None:
    """The exactness above is not an accident: starting the second half from the first
    half's parameters alone (fresh Adam state, data from the start) gives other numbers."""
    straight, _, _, _ = _train(12, None)
    first, _, _, _ = _train(5, tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model.load_state_dict(first.state_dict())
    x, y = _data()
    batches = BatchStream(x, y, 8, seed=5)
    with TrainingSession(None, model, Adam(lr=0.05), hooks=[StopAtStep(num_steps=7)]) as sess:
        while not sess.should_stop():
            images, labels = next(batches)
            sess.step(lambda: nn.functional.cross_entropy(model(images), labels))  # noqa: B023
    assert not torch.equal(model[0].weight, straight[0].weight)


def test_load_checkpoint_gives_the_models_state_dict_without_a_session(tmp_path: Path) -> None:
    trained, _, _, _ = _train(5, tmp_path)
    fresh = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    state = load_checkpoint(tmp_path, fresh)
    assert set(state) == set(trained.state_dict())
    for name, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(tmp_path: Path) -> None:
    _train(3, tmp_path)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    session = TrainingSession(None, model, Adam(lr=0.05), checkpoint_dir=tmp_path)
    with pytest.raises(CheckpointError, match=r"cannot be restored: the checkpoint does not match"):
        session.start()


def test_the_export_command_writes_the_models_state_dict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trained, _, _, _ = _train(3, tmp_path / "checkpoints")
    output = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "checkpoints"), str(output)]) == 0
    assert capsys.readouterr().out.strip() == str(output)
    exported = load_file(str(output))
    assert set(exported) == set(trained.state_dict())
    for name, value in trained.state_dict().items():
        assert torch.equal(exported[name], value), name


def test_the_export_command_without_a_checkpoint_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path), str(tmp_path / "model.safetensors")]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"tensorfleet: error: no valid checkpoint in {tmp_path}"), error
    assert not (tmp_path / "model.safetensors").exists()


def test_data_that_cannot_save_its_position_is_refused_when_the_session_is_built() -> None:
    """A generator (what ``next(batches)`` reads in most loops) has no position to save: it
    failed at the first step with a bare AttributeError; now the session names it."""

    def generator():
        while True:
            yield _data()

    model = nn.Linear(6, 3)
    with pytest.raises(ConfigTypeError, match=r"data= .*got generator, which has no state_dict"):
        TrainingSession(None, model, Adam(lr=0.05), data=generator())
