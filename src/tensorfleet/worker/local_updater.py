"""The one-process stand-in for the parameter servers, so that the same training script runs
without a cluster: the update rule is applied to the model in place, and the global step is
a local counter. Same interface as :class:`~tensorfleet.worker.client.ParameterClient`,
including :meth:`save` and :meth:`restore`: a one-process run's checkpoint is one shard
document, the same format a ps shard writes, so ``load_checkpoint`` reads both alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.worker.client import Progress
from tensorfleet.worker.moving_average import MovingAverage
from tensorfleet.worker.replica_state import decode_replica, encode_replica, load_replica


class LocalUpdater:
    """Applies the update rule locally; the model's parameters are the variables."""

    def __init__(self, ema_decay: float | None = None) -> None:
        self._optimizer: torch.optim.Optimizer | None = None
        self._global_step = 0
        self._ema_decay = ema_decay
        self._moving_average: MovingAverage | None = None
        self._named_params: list[tuple[str, torch.Tensor]] = []
        self._rule: UpdateRule | None = None
        self.restored_data: dict[str, Any] | None = None
        """This process's data position from the checkpoint restored (None: none)."""
        self._data: dict[str, Any] | None = None

    def connect(self) -> None:
        """Nothing to connect to."""

    def register(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        plan: PlacementPlan | None,
        rule: UpdateRule,
        is_chief: bool,
    ) -> int:
        self._named_params, self._rule = list(named_params), rule
        self._optimizer = rule.build([p for _, p in named_params])
        if self._ema_decay is not None:
            self._moving_average = MovingAverage(named_params, self._ema_decay)
        return self._global_step

    def pull(self) -> Progress:
        return Progress(self._global_step, stop=False)

    def push_pull(
        self,
        count_step: bool = True,
        step: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> Progress:
        if self._optimizer is None:
            raise RuntimeError("register() the model before training")
        self._optimizer.step()
        if self._moving_average is not None:
            self._moving_average.update()
        if count_step:
            self._global_step += 1
        self._data = data
        return Progress(self._global_step, stop=False)

    def save(self) -> tuple[int, list[bytearray]]:
        """The model, optimizer state, moving average, global step and data position as one
        document (the format of a ps shard's checkpoint)."""
        if self._optimizer is None or self._rule is None:
            raise RuntimeError("register() the model before saving")
        document = encode_replica(
            self._named_params,
            self._optimizer,
            self._rule,
            self._moving_average,
            self._global_step,
            {} if self._data is None else {"local": self._data},
        )
        return self._global_step, [document]

    def restore(self, documents: Sequence[bytes], global_step: int) -> None:
        """Take a checkpoint's state (ValueError naming the problem when it does not fit;
        then nothing changed)."""
        if self._optimizer is None or self._rule is None:
            raise RuntimeError("register() the model before restoring")
        if len(documents) != 1:
            raise ValueError(
                f"a one-process run restores a checkpoint of one shard, this one has {len(documents)}"
            )
        state = decode_replica(documents[0], self._named_params)
        self._optimizer = load_replica(state, self._named_params, self._rule)
        if self._moving_average is not None:
            self._moving_average.load(state.ema if state.ema is not None else state.values)
        self._global_step = global_step
        self.restored_data = state.worker_data.get("local")

    def moving_average(self) -> dict[str, torch.Tensor]:
        if self._moving_average is None:
            raise ValueError("no moving average is kept: pass ema_decay to the TrainingSession")
        return self._moving_average.state()

    def finish(self, declare_end: bool) -> None:
        """Nothing to tell anyone."""

    def close(self) -> None:
        """Nothing to close."""
