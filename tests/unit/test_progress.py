"""The chief's progress line: written by ProgressHook, parsed by the launcher's live view."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

from rich.console import Console

from tensorfleet.launch.output import LiveOutput
from tensorfleet.session.hooks import StepResult, StopAtStep
from tensorfleet.session.progress_hook import ProgressHook
from tensorfleet.session.progress_report import (
    ProgressReport,
    format_progress_line,
    parse_progress_line,
)

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_hook(hook: ProgressHook, clock: FakeClock, hooks: list, steps: list[tuple[float, int]]):
    session = SimpleNamespace(hooks=hooks, global_step=steps[0][1])
    for h in hooks:
        h.begin(session)
    for now, step in steps[1:]:
        clock.now = now
        session.global_step = step
        for h in hooks:
            h.after_step(session, StepResult(loss=0.0, global_step=step))
    hook.end(session)


def test_lines_with_the_last_step_of_stop_at_step() -> None:
    lines: list[str] = []
    clock = FakeClock()
    hook = ProgressHook(every_n_secs=10, display="lines", print_fn=lines.append, clock=clock)
    stop = StopAtStep(num_steps=1000)  # resolved in begin: 200 + 1000
    run_hook(hook, clock, [stop, hook], [(0.0, 200), (5.0, 250), (10.0, 300), (20.0, 400)])
    assert lines[0] == (
        "[progress] global step 300/1200 [#####...............] 25% 10.0 steps/s, 0:01:30 left"
    ), lines
    assert len(lines) == 2  # at 10 s and 20 s; the end adds none at the same step
    assert parse_progress_line(lines[1]) == ProgressReport(400, 1200, 10.0, 80.0)
    assert not any(CONTROL.search(line) for line in lines), lines


def test_without_a_last_step_the_line_says_so() -> None:
    lines: list[str] = []
    clock = FakeClock()
    hook = ProgressHook(every_n_secs=1, display="lines", print_fn=lines.append, clock=clock)
    run_hook(hook, clock, [hook], [(0.0, 0), (2.0, 50)])
    assert lines[0] == "[progress] global step 50 (no last step) 25.0 steps/s", lines
    report = parse_progress_line(lines[0])
    assert report is not None and report.last_step is None and report.fraction is None


def test_async_pushes_past_the_last_step_never_show_more_than_the_target() -> None:
    """In async training the pushes in flight when the last step was reached still count:
    the line read 'global step 19/18 [####################] 100%'. It shows the target and
    says how far past it the count went; the launcher parses the target."""
    lines: list[str] = []
    clock = FakeClock()
    hook = ProgressHook(
        every_n_secs=100, last_step=18, display="lines", print_fn=lines.append, clock=clock
    )
    run_hook(hook, clock, [hook], [(0.0, 0), (2.0, 19)])
    assert lines == [
        "[progress] global step 18/18 [####################] 100% (+1 in flight past the "
        "last step) 9.5 steps/s, 0:00:00 left"
    ], lines
    assert parse_progress_line(lines[0]) == ProgressReport(18, 18, 9.5, 0.0)


def test_format_and_parse_round_trip() -> None:
    for report in (
        ProgressReport(0, 3000, 0.0, None),
        ProgressReport(3000, 3000, 41.5, 0.0),
        ProgressReport(17, None, 3.2, None),
        ProgressReport(123456, 200000, 1234.5, 7_300.0),
    ):
        parsed = parse_progress_line("[worker:0] " + format_progress_line(report))
        assert parsed is not None
        assert (parsed.step, parsed.last_step, parsed.steps_per_s) == (
            report.step,
            report.last_step,
            report.steps_per_s,
        )
    assert parse_progress_line("Worker: 0, Step: 100, Accuracy (batch): 0.5") is None


def test_the_live_view_shows_the_chiefs_progress() -> None:
    console = Console(file=io.StringIO(), width=120, force_terminal=True, color_system=None)
    live = LiveOutput(console=console)
    live.task_started("worker:0", 1)
    live.line("worker:0", format_progress_line(ProgressReport(600, 1200, 20.0, 30.0)))
    assert live.progress == ProgressReport(600, 1200, 20.0, 30.0)
    console.begin_capture()
    console.print(live._render())
    panel = console.end_capture()
    assert "global step 600/1200" in panel and "50%" in panel, panel
    assert "20.0 steps/s" in panel and "0:00:30 left" in panel, panel


def test_a_session_under_the_launcher_adds_a_progress_hook_to_the_chief(monkeypatch) -> None:
    import pytest
    from torch import nn

    from tensorfleet import environment
    from tensorfleet.errors import ConfigError
    from tensorfleet.optim import SGD
    from tensorfleet.session.training_session import TrainingSession

    def progress_hooks(**options) -> list[ProgressHook]:
        session = TrainingSession(None, nn.Linear(2, 1), SGD(lr=0.1), **options)
        return [h for h in session.hooks if isinstance(h, ProgressHook)]

    monkeypatch.delenv(environment.LAUNCHER_VAR, raising=False)
    assert progress_hooks() == []  # by hand: only what the script asks for
    monkeypatch.setenv(environment.LAUNCHER_VAR, "1")
    [added] = progress_hooks(progress_secs=3.0)
    assert added.every_n_secs == 3.0
    own = ProgressHook(5.0)
    assert progress_hooks(hooks=[own]) == [own]  # the script's own, no second one
    assert progress_hooks(progress_secs=None) == []
    with pytest.raises(ConfigError, match="progress_secs must be positive.*got 0"):
        progress_hooks(progress_secs=0)
