"""Copy on write: a ps shard's values go out in replies without a copy, and stay unchanged.

A reply's value buffers leave from the store's own memory: ZeroMQ sends them later, from its
I/O thread, and until it has, those bytes must not change. The simple way is a snapshot per
reply (what the ps did until this module): one copy of the shard's values for every reply,
0.5 ms of the 5.3 ms a pull of 8 MB took on this project's machine, a tenth of it, and as
much again of the ps's time in every training step. Copy on write pays that copy only when
an update comes while a reply is still in flight: with one worker per shard never (the
worker's next push comes after it has received the reply), with several workers when their
requests queue up.

The rule: **memory lent to a reply is never written until every reply that carries it has
left.** The store calls :meth:`CopyOnWrite.before_write` before any write (an update, a
restore), naming the elements the write touches; when a reply still in flight carries any
of them, the store's flat tensors and every per-variable view of them (the optimizer's
parameters, whose state is keyed by those tensor objects) are moved, with ``Tensor.set_``,
onto memory no reply holds, holding a copy of the values: the reply keeps the old memory
alive (its buffers are views that reference it) and sends it unchanged. A write that
touches none of the elements in flight happens in place: the reply to one bucket of a push
(:mod:`tensorfleet.ps.partial_push`) lends only that bucket's slices, so the next bucket's
update, of other variables, copies nothing. Whole replies (a pull, a whole push) lend
everything. The old memory is kept as the spare for the next such copy once its replies
have left, because mapping fresh megabytes per copy (page faults) costs more than copying
into memory already mapped.

Only the store's own tensors move; nothing outside the store may keep a reference to its
flats across a write (:meth:`~tensorfleet.ps.store.VariableStore.live_values` says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

#: Elements of each flat tensor, ``(lo, hi)`` per flat; None: all of them.
Ranges = Sequence[tuple[int, int]] | None


class Tracker(Protocol):
    """What is needed of a ``zmq.MessageTracker``: whether the message has left."""

    @property
    def done(self) -> bool: ...


class CopyOnWrite:
    """The replies in flight that carry a store's memory, and the move before a write."""

    def __init__(self, max_spares: int = 2) -> None:
        self._in_flight: list[tuple[Tracker, Ranges]] = []
        self._spares: list[tuple[list[torch.Tensor], list[Tracker]]] = []
        self._max_spares = max_spares
        self.copies = 0
        """How many writes found the values still in flight and copied them first."""

    def lent(self, tracker: Tracker | None, ranges: Ranges = None) -> None:
        """The store's current values (``ranges`` of them; None: all) went out in a reply
        that ``tracker`` follows (None: nothing of the store's memory is left in flight, e.g.
        the reply copied it)."""
        if tracker is not None and not tracker.done:
            self._in_flight.append((tracker, None if ranges is None else tuple(ranges)))

    def before_write(
        self,
        flats: Sequence[torch.Tensor],
        views: Sequence[Sequence[torch.Tensor]],
        ranges: Ranges = None,
    ) -> None:
        """Make the memory of ``flats`` (each with its ``views``) that a write of ``ranges``
        (None: all) touches the store's alone again: if a reply carrying any of it is still
        in flight, move ``flats`` and ``views`` onto spare memory holding the same values,
        and keep the old memory until its replies have left."""
        self._in_flight = [(t, lent) for t, lent in self._in_flight if not t.done]
        if not any(_overlap(lent, ranges) for _, lent in self._in_flight):
            return
        spare = self._take_spare(flats)
        # Aliases of the lent memory: they keep it alive (with the replies' own views) and
        # are the spare of a later copy.
        lent = [flat.detach() for flat in flats]
        with torch.no_grad():
            for flat, flat_views, target in zip(flats, views, spare, strict=True):
                target.copy_(flat)
                storage = target.untyped_storage()
                for view in flat_views:
                    view.set_(storage, view.storage_offset(), view.shape, view.stride())
                flat.set_(storage, 0, flat.shape, flat.stride())
        if len(self._spares) < self._max_spares:
            self._spares.append((lent, [tracker for tracker, _ in self._in_flight]))
        self._in_flight = []  # all of them carry the old memory now
        self.copies += 1

    def _take_spare(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Memory for a copy of ``flats``: a kept one whose replies have all left, or new."""
        for index, (tensors, trackers) in enumerate(self._spares):
            if all(tracker.done for tracker in trackers):
                del self._spares[index]
                return tensors
        return [torch.empty_like(flat) for flat in flats]


def _overlap(lent: Ranges, written: Ranges) -> bool:
    """Whether a write of ``written`` touches an element of ``lent`` (None: all elements)."""
    if lent is None or written is None:
        return True
    return any(
        lo < hi and w_lo < w_hi and lo < w_hi and w_lo < hi
        for (lo, hi), (w_lo, w_hi) in zip(lent, written, strict=True)
    )
