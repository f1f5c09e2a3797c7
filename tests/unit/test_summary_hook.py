"""SummaryHook: averaged loss and metrics written when the global step crosses a multiple of
every_n_steps (steps may jump), throughput, ps statistics read once per point, a last point
at the end; with a fake session, and once with a real local TrainingSession."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from tensorfleet.ps.update_rules import SGD
from tensorfleet.session.hooks import Hook, StepResult
from tensorfleet.session.summary_hook import SummaryHook
from tensorfleet.session.training_session import TrainingSession
from tensorfleet.summaries import METRICS_FILE, read_metrics


class FakeSession:
    """What SummaryHook uses of a TrainingSession."""

    def __init__(self, stats: list[dict[str, Any]] | None = None) -> None:
        self.global_step = 0
        self.is_chief = True
        self.task_name = "/job:worker/task:0"
        self.stats = stats if stats is not None else []
        self.stats_calls = 0

    def cluster_stats(self) -> list[dict[str, Any]]:
        self.stats_calls += 1
        return self.stats


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _values(logdir: Path) -> list[dict[str, Any]]:
    """The records without their wall time."""
    return [
        {k: v for k, v in r.items() if k != "wall_time"}
        for r in read_metrics(logdir / METRICS_FILE)
    ]


def test_points_at_crossings_with_averages_throughput_and_ps_stats(tmp_path: Path) -> None:
    session = FakeSession(
        stats=[
            {"pushes": 9, "dropped": {"worker:1": 2, "worker:2": 3}, "max_staleness_seen": 1},
            {"pushes": 9, "dropped": {"worker:1": 100}, "max_staleness_seen": 4},
            {"pushes": 9, "max_staleness_seen": None},
        ]
    )
    clock = FakeClock()
    hook = SummaryHook(
        tmp_path, every_n_steps=10, metrics=lambda r: {"accuracy": r.aux}, clock=clock
    )
    hook.begin(session)
    # (global step after the chief's step, loss, batch accuracy): other workers make the
    # steps in between, so the global step jumps past 10 and 20 without landing on them.
    steps = [(3, 1.0, 0.5), (7, 2.0, 0.5), (12, 3.0, 0.8), (15, 4.0, 0.1), (21, 6.0, 0.2)]
    for global_step, loss, accuracy in steps:
        if global_step == 15:  # the ps counters move on
            session.stats[0]["dropped"]["worker:1"] = 4
            session.stats[2]["max_staleness_seen"] = 6
        clock.now += 2.0
        session.global_step = global_step
        hook.after_step(session, StepResult(loss=loss, global_step=global_step, aux=accuracy))
    assert session.stats_calls == 2  # once per point, not per step
    clock.now += 1.5
    session.global_step = 24
    hook.after_step(session, StepResult(loss=0.5, global_step=24, aux=1.0))
    hook.end(session)

    before = {"dropped_gradients": 5.0, "max_staleness": 4.0}  # shard 0's total; max of all
    after = {"dropped_gradients": 7.0, "max_staleness": 6.0}
    # Point at 12: steps 3, 7, 12 over 6 s; at 21: steps 15, 21 over 4 s; at 24: one step.
    assert _values(tmp_path) == [
        pytest.approx(
            {"step": 12, "loss": 2.0, "accuracy": 0.6, "global_steps_per_sec": 2.0, **before}
        ),
        pytest.approx(
            {"step": 21, "loss": 5.0, "accuracy": 0.15, "global_steps_per_sec": 2.25, **after}
        ),
        pytest.approx(
            {"step": 24, "loss": 0.5, "accuracy": 1.0, "global_steps_per_sec": 2.0, **after}
        ),
    ]
    assert session.stats_calls == 3
    scalars = EventAccumulator(str(tmp_path))
    scalars.Reload()
    assert [e.step for e in scalars.Scalars("loss")] == [12, 21, 24]
    assert [e.value for e in scalars.Scalars("global_steps_per_sec")] == [2.0, 2.25, 2.0]


def test_async_pushes_dropped_as_too_old_are_the_most_any_shard_dropped(tmp_path: Path) -> None:
    session = FakeSession(
        stats=[
            {"pushes": 9, "gradient_age": {"limit": 64, "dropped": 2}},
            {"pushes": 9, "gradient_age": {"limit": 64, "dropped": 3}},
        ]
    )
    hook = SummaryHook(tmp_path, every_n_steps=10, clock=FakeClock())
    hook.begin(session)
    session.global_step = 10
    hook.after_step(session, StepResult(loss=1.0, global_step=10))
    hook.end(session)
    assert _values(tmp_path)[0]["stale_pushes_dropped"] == 3.0


def test_without_ps_no_cluster_stats_and_a_resumed_start_counts_from_its_step(
    tmp_path: Path,
) -> None:
    session = FakeSession()
    session.global_step = 250  # restored from a checkpoint
    clock = FakeClock()
    hook = SummaryHook(tmp_path, every_n_steps=100, clock=clock)
    hook.begin(session)
    for step in range(251, 302):
        clock.now += 0.5
        session.global_step = step
        hook.after_step(session, StepResult(loss=float(step), global_step=step))
    hook.end(session)
    assert _values(tmp_path) == [
        {"step": 300, "loss": 275.5, "global_steps_per_sec": 2.0},
        {"step": 301, "loss": 301.0, "global_steps_per_sec": 2.0},
    ]


def test_end_right_after_a_point_writes_no_duplicate_and_closes(tmp_path: Path) -> None:
    session = FakeSession()
    hook = SummaryHook(tmp_path, every_n_steps=2, clock=FakeClock())
    hook.begin(session)
    for step in (1, 2):
        session.global_step = step
        hook.after_step(session, StepResult(loss=1.0, global_step=step))
    hook.end(session)
    assert [r["step"] for r in _values(tmp_path)] == [2]
    hook.end(session)  # a second end does nothing
    assert [r["step"] for r in _values(tmp_path)] == [2]


def test_metrics_that_clash_or_are_not_numbers_are_refused(tmp_path: Path) -> None:
    session = FakeSession()
    hook = SummaryHook(tmp_path, metrics=lambda r: {"loss": 1.0})
    hook.begin(session)
    with pytest.raises(ValueError, match=r"metrics returned tag\(s\) \['loss'\]"):
        hook.after_step(session, StepResult(loss=1.0, global_step=1))
    hook.metrics = lambda r: {"accuracy": "high"}
    with pytest.raises(TypeError, match="metrics returned 'high' for 'accuracy'; give a number"):
        hook.after_step(session, StepResult(loss=1.0, global_step=1))
    hook.end(session)


@pytest.mark.parametrize(
    ("every", "error", "message"),
    [
        (0, ValueError, "every_n_steps must be positive, got 0"),
        (-5, ValueError, "every_n_steps must be positive, got -5"),
        (2.5, TypeError, "every_n_steps must be an int, got 2.5"),
    ],
)
def test_bad_every_n_steps_is_refused(
    tmp_path: Path, every: object, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        SummaryHook(tmp_path, every_n_steps=every)  # type: ignore[arg-type]


def test_is_a_chief_only_hook() -> None:
    assert issubclass(SummaryHook, Hook) and SummaryHook.chief_only is True


def test_with_a_local_training_session(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(16, 3), torch.randn(16, 1)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        out = model(x)
        return nn.functional.mse_loss(out, y), out.detach()

    def spread(result: StepResult) -> dict[str, float]:
        return {"output_std": float(result.aux.std())}

    losses = []
    hook = SummaryHook(tmp_path, every_n_steps=4, metrics=spread)
    with TrainingSession(None, model, SGD(lr=0.05), hooks=[hook]) as sess:
        for _ in range(10):
            losses.append(sess.step(step).loss)
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [4, 8, 10]
    assert records[0]["loss"] == pytest.approx(sum(losses[:4]) / 4)
    assert records[2]["loss"] == pytest.approx(sum(losses[8:]) / 2)
    assert set(records[0]) == {"step", "wall_time", "loss", "output_std", "global_steps_per_sec"}
