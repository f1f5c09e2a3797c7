"""Hooks: code that runs around the training loop of a :class:`TrainingSession`.

The protocol (every method optional, all run in the training thread, in the order given):

* ``begin(session)``: once, after the variables are initialized and pulled;
* ``before_step(session)``: before each step's forward pass;
* ``after_step(session, result)``: after each step, with the :class:`StepResult`;
* ``end(session)``: once, when the session closes normally.

A hook with ``chief_only = True`` runs only on the chief (checkpoints, summaries); the others
run on every worker. A hook asks training to stop with ``session.request_stop()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorfleet.session.training_session import TrainingSession


@dataclass(frozen=True)
class StepResult:
    """What one training step produced."""

    loss: float
    global_step: int
    """The global step after this step's update was applied."""
    aux: Any = None
    """Whatever the step's closure returned besides the loss (e.g. the logits)."""
    made_step: bool = True
    """Whether this worker's update completed ``global_step`` (exactly one worker per step:
    the pusher in async mode, the last contributor in sync mode, the chief in allreduce)."""
    dropped: bool = False
    """sync mode: this worker's gradients came too late for their step and were dropped."""


class Hook:
    """Base class of hooks; override what you need."""

    chief_only: bool = False

    def begin(self, session: TrainingSession) -> None:
        """Called once before the first step."""

    def before_step(self, session: TrainingSession) -> None:
        """Called before each step."""

    def after_step(self, session: TrainingSession, result: StepResult) -> None:
        """Called after each step."""

    def end(self, session: TrainingSession) -> None:
        """Called once when the session closes without an error."""


class StopAtStep(Hook):
    """Stop when the global step reaches ``last_step`` (or after ``num_steps`` more steps
    from where the session started). Runs on every worker, so all of them stop."""

    def __init__(self, last_step: int | None = None, num_steps: int | None = None) -> None:
        if (last_step is None) == (num_steps is None):
            raise ValueError("give exactly one of last_step and num_steps")
        if (last_step if last_step is not None else num_steps) < 0:
            raise ValueError(
                f"steps must be >= 0, got last_step={last_step}, num_steps={num_steps}"
            )
        self._last_step = last_step
        self._num_steps = num_steps

    @property
    def last_step(self) -> int | None:
        return self._last_step

    def begin(self, session: TrainingSession) -> None:
        if self._last_step is None:
            self._last_step = session.global_step + self._num_steps
        if session.global_step >= self._last_step:
            session.request_stop()

    def after_step(self, session: TrainingSession, result: StepResult) -> None:
        if result.global_step >= self._last_step:
            session.request_stop()


class LoggingHook(Hook):
    """Print a line each time the global step reaches a multiple of ``every_n_steps``.

    Exactly one worker makes each global step (see :attr:`StepResult.made_step`), and only
    that worker prints its line. ``formatter(session, result)`` makes
    the line; return None to print nothing.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        formatter: Callable[[TrainingSession, StepResult], str | None] | None = None,
        print_fn: Callable[[str], None] = print,
    ) -> None:
        if every_n_steps <= 0:
            raise ValueError(f"every_n_steps must be positive, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.formatter = formatter or (
            lambda s, r: f"{s.task_name}: global step {r.global_step}, loss {r.loss:.4f}"
        )
        self.print_fn = print_fn

    def after_step(self, session: TrainingSession, result: StepResult) -> None:
        if result.made_step and result.global_step % self.every_n_steps == 0:
            line = self.formatter(session, result)
            if line is not None:
                self.print_fn(line)
