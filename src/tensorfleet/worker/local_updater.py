"""The one-process stand-in for the parameter servers, so that the same training script runs
without a cluster: the update rule is applied to the model in place, and the global step is
a local counter. It implements the :class:`~tensorfleet.worker.updater.Updater` protocol; a
one-process run's checkpoint is one shard document, the same format a ps shard writes, so
``load_checkpoint`` reads both alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tensorfleet.errors import CheckpointError, ConfigError, UsageError
from tensorfleet.ps.buffer_policies import persistent_buffers
from tensorfleet.ps.shard_checkpoint import ShardState
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.worker.moving_average import MovingAverage
from tensorfleet.worker.progress import Progress
from tensorfleet.worker.replica_state import (
    check_buffers,
    decode_replica,
    encode_replica,
    load_buffers,
    load_replica,
)
from tensorfleet.worker.updater import (
    CheckpointSource,
    DataPosition,
    NamedParams,
    Restored,
    SavedState,
    whole_placement,
)


class LocalUpdater:
    """Applies the update rule locally; the model's parameters are the variables."""

    discipline: UpdateDiscipline | None = None
    collective = False

    def __init__(self, ema_decay: float | None = None) -> None:
        self._optimizer: torch.optim.Optimizer | None = None
        self._global_step = 0
        self._ema_decay = ema_decay
        self._moving_average: MovingAverage | None = None
        self._named_params: list[tuple[str, torch.Tensor]] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._rule: UpdateRule | None = None
        self._data: dict[str, Any] | None = None

    def connect(self, device: torch.device | None = None) -> None:
        """Nothing to connect to."""

    def wrap(self, model: nn.Module) -> nn.Module:
        self._buffers = persistent_buffers(model)
        return model

    def register(self, named_params: NamedParams, rule: UpdateRule) -> None:
        self._named_params, self._rule = list(named_params), rule
        self._optimizer = rule.build([p for _, p in named_params])
        if self._ema_decay is not None:
            self._moving_average = MovingAverage(named_params, self._ema_decay)

    def restore(self, checkpoints: CheckpointSource | None, resume: bool = True) -> Restored:
        """Resume from the newest valid checkpoint, if there is one (and ``resume``)."""
        checkpoint = checkpoints.newest() if checkpoints is not None and resume else None
        if checkpoint is None:
            return Restored(self._global_step)
        try:  # nothing changes until the whole checkpoint is known to fit
            state = self._decode(checkpoint.documents)
            check_buffers(state.buffers, self._buffers)
            optimizer = load_replica(state, self._named_params, self._rule)
            load_buffers(state.buffers, self._buffers)
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} cannot be restored: {exc}. Start fresh "
                "(restore=False) or point checkpoint_dir elsewhere"
            ) from None
        checkpoints.restoring(checkpoint)
        self._optimizer = optimizer
        if self._moving_average is not None:
            self._moving_average.load(state.ema if state.ema is not None else state.values)
        self._global_step = checkpoint.global_step
        return Restored(self._global_step, state.worker_data.get("local"))

    def _decode(self, documents: Sequence[bytes]) -> ShardState:
        if self._optimizer is None or self._rule is None:
            raise UsageError("register() the model before restoring")
        if len(documents) != 1:
            raise ConfigError(
                f"a one-process run restores a checkpoint of one shard, this one has {len(documents)}"
            )
        return decode_replica(documents[0], self._named_params)

    def pull(self) -> Progress:
        return Progress(self._global_step, stop=False)

    def push_pull(
        self,
        count_step: bool = True,
        step: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> Progress:
        """Apply the gradients; ``count_step`` False applies them without counting a step."""
        if self._optimizer is None:
            raise UsageError("register() the model before training")
        self._optimizer.step()
        if self._moving_average is not None:
            self._moving_average.update()
        if count_step:
            self._global_step += 1
        self._data = data
        return Progress(self._global_step, stop=False)

    def exchange(self, step: int, data: DataPosition | None) -> Progress:
        return self.push_pull(step=step, data=data)

    def skip(self, step: int) -> Progress:
        """Nothing to exchange: the update is simply not applied."""
        return Progress(self._global_step, stop=False, made_step=False, dropped=True)

    def agree(self, stop: bool, checkpoint: bool = False) -> tuple[bool, bool]:
        return stop, checkpoint

    def save(self, data: DataPosition | None = None) -> SavedState:
        """The model, optimizer state, moving average, global step and data position (as of
        the last exchange) as one document (the format of a ps shard's checkpoint)."""
        if self._optimizer is None or self._rule is None:
            raise UsageError("register() the model before saving")
        document = encode_replica(
            self._named_params,
            self._optimizer,
            self._rule,
            self._moving_average,
            self._global_step,
            {} if self._data is None else {"local": self._data},
            self._buffers,
        )
        return SavedState(self._global_step, [document], whole_placement(self._named_params))

    def finish(self, before_done: Callable[[], object] | None, failed: bool = False) -> None:
        """Nobody to tell: the final checkpoint, unless the loop failed."""
        if before_done is not None and not failed:
            before_done()

    def leave(self) -> None:
        """Nobody waits for this process."""

    def close(self) -> None:
        """Nothing to close."""

    def stats(self) -> list[dict[str, Any]]:
        return []

    def moving_average(self) -> dict[str, torch.Tensor]:
        if self._moving_average is None:
            raise ConfigError("no moving average is kept: pass ema_decay to the TrainingSession")
        return self._moving_average.state()
