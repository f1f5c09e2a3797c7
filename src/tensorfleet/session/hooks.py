"""Hooks: code that runs around the training loop of a :class:`TrainingSession`.

The protocol (every method optional, all run in the training thread, in the order given):

* ``begin(session)``: once, after the variables are initialized and pulled;
* ``before_step(session)``: before each step's forward pass;
* ``before_update(session, loss)``: after the backward pass, before the gradients are
  exchanged; return False to skip this step's update (the NaN guard does);
* ``after_step(session, result)``: after each step, with the :class:`StepResult`;
* ``end(session)``: once, when the session closes normally (before the chief's final
  checkpoint).

A hook with ``chief_only = True`` runs only on the chief (checkpoints, summaries); the others
run on every worker. A hook asks training to stop with ``session.request_stop()``, or fails
it by raising.

Built in: :class:`StopAtStep`, :class:`LoggingHook`, :class:`CheckpointHook` (chief),
:class:`NanGuard`, and ``SummaryHook`` (chief; :mod:`tensorfleet.session.summary_hook`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tensorfleet.errors import ConfigError, DeadlineExceeded, NonFiniteError, ServiceRestarted

if TYPE_CHECKING:
    from tensorfleet.session.training_session import TrainingSession

log = logging.getLogger("tensorfleet.session")


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

    def before_update(self, session: TrainingSession, loss: torch.Tensor) -> bool:
        """Called after the backward pass; return False to skip this step's update."""
        return True

    def after_step(self, session: TrainingSession, result: StepResult) -> None:
        """Called after each step."""

    def end(self, session: TrainingSession) -> None:
        """Called once when the session closes without an error."""


def can_veto(hook: Hook) -> bool:
    """Whether ``hook`` overrides :meth:`Hook.before_update` (and so may look at the whole
    gradient and veto the update after the backward pass)."""
    return type(hook).before_update is not Hook.before_update


class StopAtStep(Hook):
    """Stop when the global step reaches ``last_step`` (or after ``num_steps`` more steps
    from where the session started). Runs on every worker, so all of them stop. In ``async``
    mode the workers' pushes in flight when the first of them sees ``last_step`` still
    count: the run ends a step or a few past it (``last_step=600`` with 2 workers may end,
    and write its final checkpoint, at 601); ``sync`` and ``allreduce`` end at it."""

    def __init__(self, last_step: int | None = None, num_steps: int | None = None) -> None:
        if (last_step is None) == (num_steps is None):
            raise ConfigError("give exactly one of last_step and num_steps")
        if (last_step if last_step is not None else num_steps) < 0:
            raise ConfigError(
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
            raise ConfigError(f"every_n_steps must be positive, got {every_n_steps}")
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


class CheckpointHook(Hook):
    """The chief saves a checkpoint every ``every_n_steps`` global steps and/or every
    ``every_n_secs`` seconds (the session's ``checkpoint_dir``; the final one is written by
    the session at the end, after the other workers finished). The session adds one when
    it is given a ``checkpoint_dir``."""

    chief_only = True

    def __init__(self, every_n_steps: int | None = None, every_n_secs: float | None = None) -> None:
        if every_n_steps is None and every_n_secs is None:
            raise ConfigError("give every_n_steps, every_n_secs, or both")
        if every_n_steps is not None and every_n_steps <= 0:
            raise ConfigError(f"every_n_steps must be positive, got {every_n_steps}")
        if every_n_secs is not None and not every_n_secs > 0:
            raise ConfigError(f"every_n_secs must be positive, got {every_n_secs}")
        self.every_n_steps = every_n_steps
        self.every_n_secs = every_n_secs
        self._last_step = 0
        self._last_time = 0.0

    def begin(self, session: TrainingSession) -> None:
        self._last_step = session.global_step
        self._last_time = time.monotonic()

    def after_step(self, session: TrainingSession, result: StepResult) -> None:
        steps_due = (
            self.every_n_steps is not None
            and result.global_step // self.every_n_steps > self._last_step // self.every_n_steps
        )
        time_due = (
            self.every_n_secs is not None
            and time.monotonic() - self._last_time >= self.every_n_secs
        )
        if steps_due or time_due:
            try:
                session.request_checkpoint()  # in allreduce mode: at the next agreement
            except (DeadlineExceeded, ServiceRestarted) as exc:
                # A ps failed during the save: the next step recovers (and restores it);
                # this checkpoint is skipped, the earlier ones are intact.
                log.warning("checkpoint of global step %d skipped: %s", result.global_step, exc)
            self._last_step = result.global_step
            self._last_time = time.monotonic()


class NanGuard(Hook):
    """Checks the loss and the gradients of every step for NaN and infinity.

    ``action="stop"`` raises :class:`~tensorfleet.errors.NonFiniteError` naming the step and
    the loss, before the bad update reaches anyone (TensorFlow's NanTensorHook);
    ``action="skip"`` skips that update and goes on (counted in :attr:`skipped`), and stops
    the same way after ``max_consecutive`` bad steps in a row (a diverged model does not
    recover by skipping). Runs on every worker."""

    def __init__(self, action: str = "stop", max_consecutive: int = 100) -> None:
        if action not in ("stop", "skip"):
            raise ConfigError(f"action must be 'stop' or 'skip', got {action!r}")
        if max_consecutive < 1:
            raise ConfigError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.action = action
        self.max_consecutive = max_consecutive
        self.skipped = 0
        self._in_a_row = 0
        self._params: list[torch.Tensor] | None = None

    def begin(self, session: TrainingSession) -> None:
        self._params = list(session.model.parameters())  # not walked again at every step

    def before_update(self, session: TrainingSession, loss: torch.Tensor) -> bool:
        value = float(loss.detach())
        finite = math.isfinite(value) and self._gradients_finite(session)
        if finite:
            self._in_a_row = 0
            return True
        self._in_a_row += 1
        what = f"loss {value}" if not math.isfinite(value) else "a non-finite gradient"
        if self.action == "stop" or self._in_a_row >= self.max_consecutive:
            raise NonFiniteError(
                f"{session.task_name}: {what} at global step {session.global_step}"
                + (f" ({self._in_a_row} bad steps in a row)" if self.action == "skip" else "")
                + "; the update was not applied. Lower the learning rate, clip gradients "
                "(clip_grad_norm=), or check the input data; the newest checkpoint holds the "
                "model before the divergence"
            )
        self.skipped += 1
        return False

    def _gradients_finite(self, session: TrainingSession) -> bool:
        """Whether every gradient is finite, read once per device (a GPU is not waited for
        once per parameter)."""
        params = self._params if self._params is not None else session.model.parameters()
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for param in params:
            if param.grad is not None:
                by_device.setdefault(param.grad.device, []).append(param.grad.isfinite().all())
        return all(bool(torch.stack(checks).all()) for checks in by_device.values())
