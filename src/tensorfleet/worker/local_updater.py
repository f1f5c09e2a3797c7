"""The one-process stand-in for the parameter servers, so that the same training script runs
without a cluster: the update rule is applied to the model in place, and the global step is
a local counter. Same interface as :class:`~tensorfleet.worker.client.ParameterClient`,
including :meth:`save` and :meth:`restore`: a one-process run's checkpoint is one shard
document, the same format a ps shard writes, so ``load_checkpoint`` reads both alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorfleet.errors import ProtocolError
from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.ps.shard_checkpoint import decode_shard, encode_shard
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.worker.client import Progress
from tensorfleet.worker.moving_average import MovingAverage


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

    def save(self) -> tuple[int, list[bytes]]:
        """The model, optimizer state, moving average, global step and data position as one
        shard document (the format of a ps shard's checkpoint)."""
        if self._optimizer is None or self._rule is None:
            raise RuntimeError("register() the model before saving")
        layout = self._layout()
        params = dict(self._named_params)
        optimizer: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in self._named_params:
            state = {
                key: (value if isinstance(value, torch.Tensor) else torch.tensor(float(value)))
                .detach()
                .cpu()
                .clone()
                for key, value in self._optimizer.state.get(param, {}).items()
            }
            if state:
                optimizer[name] = state
        document = encode_shard(
            shard=0,
            global_step=self._global_step,
            version=self._global_step,
            rule=self._rule.to_wire(),
            layout=layout,
            values={name: params[name].detach().cpu().clone() for name, _ in self._named_params},
            ema=None if self._moving_average is None else self._moving_average.state(),
            optimizer=optimizer,
            worker_data={} if self._data is None else {"local": self._data},
        )
        return self._global_step, [document]

    def restore(self, documents: Sequence[bytes], global_step: int) -> None:
        """Take a checkpoint's state (ValueError naming the problem when it does not fit)."""
        if self._optimizer is None or self._rule is None:
            raise RuntimeError("register() the model before restoring")
        if len(documents) != 1:
            raise ValueError(
                f"a one-process run restores a checkpoint of one shard, this one has {len(documents)}"
            )
        try:
            state = decode_shard(documents[0])
        except ProtocolError as exc:
            raise ValueError(f"the checkpoint cannot be read: {exc}") from None
        difference = self._layout().describe_difference(state.layout)
        if difference is not None:
            raise ValueError(f"the checkpoint does not match the model: {difference}")
        params = [p for _, p in self._named_params]
        fresh = self._rule.build(params)
        index = {name: i for i, (name, _) in enumerate(self._named_params)}
        fresh.load_state_dict(
            {
                "state": {index[name]: dict(tensors) for name, tensors in state.optimizer.items()},
                "param_groups": fresh.state_dict()["param_groups"],
            }
        )
        with torch.no_grad():
            for name, param in self._named_params:
                param.copy_(state.values[name])
        if self._moving_average is not None:
            self._moving_average.load(state.ema if state.ema is not None else state.values)
        self._optimizer = fresh
        self._global_step = global_step
        self.restored_data = state.worker_data.get("local")

    def _layout(self) -> FusedLayout:
        return FusedLayout.of(
            [
                StoredVariable(name, tuple(p.shape), dtype_name(p.dtype))
                for name, p in self._named_params
            ]
        )

    def moving_average(self) -> dict[str, torch.Tensor]:
        if self._moving_average is None:
            raise ValueError("no moving average is kept: pass ema_decay to the TrainingSession")
        return self._moving_average.state()

    def finish(self, declare_end: bool) -> None:
        """Nothing to tell anyone."""

    def close(self) -> None:
        """Nothing to close."""
