"""The state of a replica that updates itself (one process, or one worker of an all-reduce
group) as a checkpoint document: the same safetensors format a ps shard writes, so one
checkpoint directory, ``load_checkpoint`` and ``export_checkpoint`` serve every mode.

A replica's state: its parameters, its torch optimizer's state, its moving average (if
kept), the global step and the workers' data positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tensorfleet.errors import CheckpointMismatch, ProtocolError
from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.shard_checkpoint import ShardState, decode_shard, encode_shard
from tensorfleet.ps.store import check_optimizer_state, reference_optimizer_state
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.worker.moving_average import MovingAverage

NamedParams = Sequence[tuple[str, torch.Tensor]]


def replica_layout(named_params: NamedParams) -> FusedLayout:
    """The layout a replica's document describes: every parameter whole, in model order."""
    return FusedLayout.of(
        [StoredVariable(name, tuple(p.shape), dtype_name(p.dtype)) for name, p in named_params]
    )


def encode_replica(
    named_params: NamedParams,
    optimizer: torch.optim.Optimizer,
    rule: UpdateRule,
    moving_average: MovingAverage | None,
    global_step: int,
    worker_data: dict[str, dict[str, Any]],
    buffers: dict[str, torch.Tensor] | None = None,
    tables: dict[str, bytes] | None = None,
) -> bytearray:
    """The checkpoint document of a replica (its parameters and persistent ``buffers`` are
    copied, on any device); ``tables``: its embedding tables' row-store documents by name
    (``table/<name>``, as a ps shard's), for a one-process run with tables."""
    states: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in named_params:
        state = {
            key: value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            for key, value in optimizer.state.get(param, {}).items()
        }
        if state:
            states[name] = state
    return encode_shard(
        shard=0,
        global_step=global_step,
        version=global_step,
        rule=rule.to_wire(),
        layout=replica_layout(named_params),
        values={name: p.detach() for name, p in named_params},
        ema=None if moving_average is None else moving_average.state(),
        optimizer=states,
        worker_data=worker_data,
        buffers={name: b.detach().cpu() for name, b in (buffers or {}).items()},
        tables=tables or {},
    )


def decode_replica(
    document: bytes | bytearray | memoryview, named_params: NamedParams
) -> ShardState:
    """A replica's document, checked against this model (:class:`CheckpointMismatch` naming the difference)."""
    try:
        state = decode_shard(document)
    except ProtocolError as exc:
        raise CheckpointMismatch(f"the checkpoint cannot be read: {exc}") from None
    difference = replica_layout(named_params).describe_difference(state.layout)
    if difference is not None:
        raise CheckpointMismatch(f"the checkpoint does not match the model: {difference}")
    return state


def load_replica(
    state: ShardState, named_params: NamedParams, rule: UpdateRule
) -> torch.optim.Optimizer:
    """Copy a checked document's values into the parameters and return a fresh optimizer
    holding its state (ValueError, with nothing changed, if that state does not fit)."""
    names = [name for name, _ in named_params]
    params = [p for _, p in named_params]
    check_optimizer_state(rule, replica_layout(named_params).variables, params, state.optimizer)
    optimizer = rule.build(params)
    index = {name: i for i, name in enumerate(names)}
    optimizer.load_state_dict(
        {
            "state": {index[name]: dict(tensors) for name, tensors in state.optimizer.items()},
            "param_groups": optimizer.state_dict()["param_groups"],
        }
    )
    with torch.no_grad():
        for name, param in named_params:
            param.copy_(state.values[name])
    return optimizer


def check_buffers(saved: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    """Check that a checkpoint's ``saved`` buffers fit the model's persistent ``buffers``
    (:class:`CheckpointMismatch` naming the first difference). A checkpoint without buffers
    (written before buffers were saved) fits any model."""
    unknown = sorted(set(saved) - set(buffers))
    if unknown:
        raise CheckpointMismatch(
            f"the checkpoint holds buffers {unknown} that the model does not have; its "
            f"persistent buffers are {sorted(buffers)}"
        )
    for name, value in saved.items():
        mine = buffers[name]
        if value.dtype != mine.dtype or value.shape != mine.shape:
            raise CheckpointMismatch(
                f"buffer {name!r} is {value.dtype} {list(value.shape)} in the checkpoint, "
                f"{mine.dtype} {list(mine.shape)} in the model"
            )


def load_buffers(saved: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    """Copy a checkpoint's ``saved`` buffers into the model's (checked first)."""
    check_buffers(saved, buffers)
    with torch.no_grad():
        for name, value in saved.items():
            buffers[name].copy_(value)


def optimizer_state_template(
    rule: UpdateRule, named_params: NamedParams
) -> dict[str, dict[str, torch.Tensor]]:
    """Zero tensors shaped like the optimizer state ``rule`` keeps for these parameters
    (what a replica that has no checkpoint receives a broadcast into)."""
    params = [p for _, p in named_params]
    template = reference_optimizer_state(rule, params)
    return {
        name: {key: torch.zeros_like(value) for key, value in template[i].items()}
        for i, (name, _) in enumerate(named_params)
        if template[i]
    }
