"""An exponential moving average of a model's parameters, kept where the parameters live
when that is the worker itself (one process, or all-reduce). With parameter servers the ps
shards keep it instead."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorfleet.errors import ConfigError


class MovingAverage:
    """``average = decay * average + (1 - decay) * parameter`` after every update."""

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self._params = list(named_params)
        self._averages = {name: p.detach().clone() for name, p in self._params}

    def update(self) -> None:
        with torch.no_grad():
            for name, p in self._params:
                self._averages[name].lerp_(p.detach(), 1.0 - self.decay)

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the averages, by parameter name (load it into an evaluation model)."""
        return {name: t.clone() for name, t in self._averages.items()}

    def load(self, averages: dict[str, torch.Tensor]) -> None:
        """Take the averages of a checkpoint (by parameter name, shaped like the parameters)."""
        with torch.no_grad():
            for name, average in self._averages.items():
                average.copy_(averages[name])
