"""Reusable buffers for the variable values a ps shard sends in its replies.

A reply's buffers go out without a copy (ZeroMQ sends them from our memory), so they must
not change until ZeroMQ has sent them; the pool hands out a buffer again only once the
tracker of the reply that carried it says it has left.
"""

from __future__ import annotations

import torch
import zmq

from tensorfleet.ps.store import VariableStore


class SnapshotPool:
    """Reusable buffers for the values sent in replies.

    A reply's buffers go out without a copy, so they must not change until ZeroMQ has sent
    them. A fresh copy per reply would do, but allocating (and page-faulting) megabytes per
    reply costs more than copying into memory that is already mapped. A buffer is reused
    once the tracker of the reply that carried it says it has left.
    """

    def __init__(self, store: VariableStore, max_buffers: int = 8) -> None:
        self._store = store
        self._max_buffers = max_buffers
        self._entries: list[tuple[list[torch.Tensor], zmq.MessageTracker | None]] = []

    def take(self) -> tuple[int, list[torch.Tensor]]:
        """A snapshot of the store's values and its slot (give it back to :meth:`sent`)."""
        for slot, (tensors, tracker) in enumerate(self._entries):
            if tracker is None or tracker.done:
                self._store.snapshot_into(tensors)
                self._entries[slot] = (tensors, None)
                return slot, tensors
        tensors = self._store.snapshot()
        if len(self._entries) < self._max_buffers:
            self._entries.append((tensors, None))
            return len(self._entries) - 1, tensors
        return -1, tensors  # every pooled buffer is in flight: this one is used once

    def sent(self, slot: int, tracker: zmq.MessageTracker | None) -> None:
        """Record the tracker of the reply carrying slot ``slot`` (None: nothing holds it)."""
        if slot >= 0:
            self._entries[slot] = (self._entries[slot][0], tracker)
