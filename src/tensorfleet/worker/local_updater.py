"""The one-process stand-in for the parameter servers, so that the same training script runs
without a cluster: the update rule is applied to the model in place, and the global step is
a local counter. Same interface as :class:`~tensorfleet.worker.client.ParameterClient`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.worker.client import Progress
from tensorfleet.worker.moving_average import MovingAverage


class LocalUpdater:
    """Applies the update rule locally; the model's parameters are the variables."""

    def __init__(self, ema_decay: float | None = None) -> None:
        self._optimizer: torch.optim.Optimizer | None = None
        self._global_step = 0
        self._ema_decay = ema_decay
        self._moving_average: MovingAverage | None = None

    def connect(self) -> None:
        """Nothing to connect to."""

    def register(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        plan: PlacementPlan | None,
        rule: UpdateRule,
        is_chief: bool,
    ) -> int:
        self._optimizer = rule.build([p for _, p in named_params])
        if self._ema_decay is not None:
            self._moving_average = MovingAverage(named_params, self._ema_decay)
        return self._global_step

    def pull(self) -> Progress:
        return Progress(self._global_step, stop=False)

    def push_pull(self, count_step: bool = True, step: int | None = None) -> Progress:
        if self._optimizer is None:
            raise RuntimeError("register() the model before training")
        self._optimizer.step()
        if self._moving_average is not None:
            self._moving_average.update()
        if count_step:
            self._global_step += 1
        return Progress(self._global_step, stop=False)

    def moving_average(self) -> dict[str, torch.Tensor]:
        if self._moving_average is None:
            raise ValueError("no moving average is kept: pass ema_decay to the TrainingSession")
        return self._moving_average.state()

    def finish(self, declare_end: bool) -> None:
        """Nothing to tell anyone."""

    def close(self) -> None:
        """Nothing to close."""
