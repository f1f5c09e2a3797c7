"""``TrainingSession.optimizer``: torch's learning-rate schedulers drive the session's update
rule. In one process a run with a scheduler attached to it equals the plain PyTorch loop with
the same scheduler on its optimizer, bit for bit (the other modes apply the same
hyperparameters: ``test_updater_conformance.py``, ``test_update_log.py`` and the cluster test
``tests/cluster/test_sync_and_allreduce.py``); the scheduler sees the session's steps as
an optimizer's (no warning); what the rule cannot take is refused by name."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.errors import ConfigError
from tensorfleet.session.rule_optimizer import RuleOptimizer

Scheduler = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
SCHEDULERS: dict[str, Scheduler] = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "one_cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=12),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize(
    "rule",
    [tfl.optim.SGD(lr=0.1, momentum=0.9), tfl.optim.Adam(lr=0.01)],
    ids=["momentum", "adam"],
)
def test_a_scheduler_on_the_sessions_optimizer_trains_as_on_torchs(scheduler: str, rule) -> None:
    plain = _model()
    optimizer = rule.build(list(plain.parameters()))
    plain_schedule = SCHEDULERS[scheduler](optimizer)
    for step in range(12):
        optimizer.zero_grad()
        x, y = _batch(step)
        nn.functional.mse_loss(plain(x), y).backward()
        optimizer.step()
        plain_schedule.step()

    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        with tfl.TrainingSession(None, model, optimizer=rule, progress_secs=None) as sess:
            schedule = SCHEDULERS[scheduler](sess.optimizer)
            for step in range(12):
                x, y = _batch(step)
                sess.step(lambda x=x, y=y: nn.functional.mse_loss(model(x), y))
                schedule.step()
    for (name, mine), theirs in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(mine, theirs), name


def test_the_changes_are_the_rules_hyperparameters_with_the_groups_values() -> None:
    rule = tfl.optim.SGD(lr=0.1, momentum=0.9)
    optimizer = RuleOptimizer(rule)
    assert optimizer.changes() == {} and optimizer.due() is None
    optimizer.param_groups[0]["lr"] = 0.05
    assert optimizer.changes() == {**rule.hyperparameters, "lr": 0.05}
    assert optimizer.due() == {**rule.hyperparameters, "lr": 0.05}
    assert optimizer.due() is None  # applied already
    optimizer.param_groups[0]["lr"] = 0.1  # back to the rule's: applied again
    assert optimizer.due() == dict(rule.hyperparameters)


def test_a_value_the_rule_cannot_take_is_refused_naming_it() -> None:
    model = _model()
    with tfl.TrainingSession(
        None, model, optimizer=tfl.optim.SGD(lr=0.1), progress_secs=None
    ) as sess:
        sess.optimizer.param_groups[0]["lr"] = "fast"
        x, y = _batch(0)
        with pytest.raises(ConfigError, match="lr='fast'"):
            sess.step(lambda: nn.functional.mse_loss(model(x), y))
        sess.request_stop()


def test_a_schedule_brought_back_before_the_first_step_raises_no_warning() -> None:
    """A resumed run steps its scheduler to the epoch it was at before any session step
    (docs/concepts.md): torch would warn that the schedule's first value is skipped, which
    is not so here (the values are read at each step)."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tfl.TrainingSession(
            None, model, optimizer=tfl.optim.SGD(lr=0.1), progress_secs=None
        ) as sess:
            schedule = torch.optim.lr_scheduler.StepLR(sess.optimizer, step_size=1, gamma=0.5)
            schedule.step()  # epoch 1 of a resumed run
            x, y = _batch(0)
            sess.step(lambda: nn.functional.mse_loss(model(x), y))
            assert sess.optimizer.param_groups[0]["lr"] == 0.05
