"""What a ps shard does with checkpoints: the document a ``save`` answers with, and the checks
a ``restore`` (or a ``create`` from a checkpoint) passes before the shard changes.

The document format itself (safetensors, its metadata, its own checks) is
:mod:`tensorfleet.ps.shard_checkpoint`; this module holds the shard's side of the requests, so
that the service only dispatches them: every check here runs before anything changes, so a
refused restore leaves the shard as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorfleet.errors import ConfigError, ProtocolError
from tensorfleet.ps.layout import FusedLayout
from tensorfleet.ps.shard_checkpoint import (
    ShardState,
    decode_shard,
    encode_shard,
    encode_shard_pieces,
)
from tensorfleet.ps.store import VariableStore
from tensorfleet.ps.update_log_segment import checkpoint_id
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.wire.auth import Buffer


def _shard_fields(
    shard_index: int, store: VariableStore, global_step: int, worker_data: dict[str, dict]
) -> dict[str, Any]:
    """What a shard document says of the shard's dense state (the keyword arguments of
    :func:`encode_shard`): views of the live state, to be encoded before the store changes."""
    values, ema, optimizer = store.checkpoint_parts(copy=False)
    return {
        "shard": shard_index,
        "global_step": global_step,
        "version": store.version,
        "rule": store.rule.to_wire(),
        "layout": store.layout,
        "values": values,
        "ema": ema,
        "optimizer": optimizer,
        "worker_data": worker_data,
    }


def save_document(
    shard_index: int,
    store: VariableStore,
    global_step: int,
    worker_data: dict[str, dict],
    buffers: dict[str, torch.Tensor] | None = None,
    tables: dict[str, bytes] | None = None,
) -> bytes:
    """The shard's state as one safetensors document (a checkpoint's shard file), with the
    persistent ``buffers`` it holds."""
    fields = _shard_fields(shard_index, store, global_step, worker_data)
    return encode_shard(**fields, buffers=buffers, tables=tables)  # copied by the encoding


def live_checkpoint_id(shard_index: int, store: VariableStore, global_step: int) -> int:
    """:func:`~tensorfleet.ps.update_log_segment.checkpoint_id` of the shard's live dense
    state (what a save's document holds of it)."""
    values, ema, optimizer = store.checkpoint_parts(copy=False)
    return checkpoint_id(shard_index, global_step, store.version, values, ema, optimizer)


def snapshot_pieces(
    shard_index: int, store: VariableStore, global_step: int, worker_data: dict[str, dict]
) -> list[memoryview]:
    """The shard's dense state as the pieces of a shard document without buffers or tables
    (the update log's snapshot), uncopied: write them before the store changes."""
    return encode_shard_pieces(**_shard_fields(shard_index, store, global_step, worker_data))


def checked_checkpoint(
    shard_index: int,
    body: dict[str, Any],
    buffers: list[Buffer],
    layout: FusedLayout,
    applied_rule: str,
) -> ShardState:
    """The shard document of a ``restore`` (or ``create`` with ``restore``) request, checked
    against this shard: its index, the variables' ``layout``, the update rule the shard
    applies (``applied_rule``), and the request's ``global_step``. Raises
    :class:`ProtocolError` for a malformed request or document and :class:`ConfigError` (a
    ``ValueError``) for one that does not fit, naming what differs."""
    if len(buffers) != 1:
        raise ProtocolError(f"a restore carries one shard document, got {len(buffers)} buffers")
    checkpoint = decode_shard(buffers[0])
    if checkpoint.shard != shard_index:
        raise ConfigError(
            f"the checkpoint's document is of ps:{checkpoint.shard}, this is ps:{shard_index}"
        )
    difference = layout.describe_difference(checkpoint.layout)
    if difference is not None:
        raise ConfigError(f"the checkpoint does not match the variables: {difference}")
    rule = UpdateRule.from_wire(checkpoint.rule)
    if rule.name != applied_rule:
        raise ConfigError(
            f"the checkpoint was made with rule {rule.name!r}, this shard applies {applied_rule!r}: "
            "restore it with the same optimizer, or start fresh"
        )
    step = body.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ProtocolError(f"a restore needs the checkpoint's global_step, got {step!r}")
    return checkpoint


def group_values(layout: FusedLayout, checkpoint: ShardState) -> list[torch.Tensor]:
    """The checkpoint's values as one flat tensor per dtype group of ``layout`` (what a
    ``create`` from a checkpoint starts the store with)."""
    return [
        torch.cat([checkpoint.values[var.name].reshape(-1) for var, _ in group.members])
        for group in layout.groups
    ]


def restore_into(store: VariableStore, checkpoint: ShardState) -> None:
    """Bring ``store`` to the checkpoint's values, moving average, optimizer state and
    version (the store checks them all before it changes)."""
    store.restore(checkpoint.values, checkpoint.ema, checkpoint.optimizer, checkpoint.version)
