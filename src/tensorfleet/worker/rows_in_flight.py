"""A step's row gradients sent without waiting, their replies awaited after the dense
exchange: the rows' round trip overlaps the dense one instead of coming before it.

What: in a step of a model with embedding tables (or ``sparse=True`` embedding weights held
as rows), :class:`~tensorfleet.worker.ps_row_source.PsRowSource` sends each shard its part
of the row gradients (``push_rows``) and, while a :class:`RowsInFlight` is open, does not
wait for the replies: the dense exchange (the gradients' push, or the last bucket of the
overlapped push) goes right after on the same channels, and the rows' replies are taken once
its replies are in (:meth:`RowsInFlight.settle`). With ``Overlap(prefetch=True)`` a step
does not wait for its dense replies either: its rows stay in flight with them and are
settled at the next step's exchange, before its own rows are sent (and before a pull, a
checkpoint, ``cluster_stats()`` and the session's end: ``PsUpdater.exchange`` and
``PsUpdater._settle``), so at most one step's row pushes are in flight.

Why: the step of the click model on 2 ps was mostly waiting (about three quarters of the
worker's step, measured by ``benchmarks/sparse_tables.py --parts click``): a lookup per shard,
one after the other, a row push, then the dense push, each a full round trip to shards that
share two cores with the workers. Each wait costs the latency of a round trip (a scheduling
slice of the ps process on a loaded host), not its bytes. Sending the rows and the dense
gradients back to back leaves one wait where there were two; the lookup of a table asks all
its shards at once (:meth:`PsRowSource.pull_rows_of`), one wait where there was one per shard.

Nothing changes in what the shards compute: a shard answers the requests of one channel in
the order they arrive (ZeroMQ keeps a connection's order and a shard's loop is one thread), so
the rows are applied (async), held for the step's mean (sync) or for the staleness gate before
the dense push is seen, exactly as when the worker waited in between; the sync-mode equality
with one process holds bit for bit.

The alternative, carrying every table's rows inside the dense push itself (one request per
shard), saves the second request's header and dispatch too, but changes the ``push`` request
and the partial pushes of the overlapped path on both ends, their checks and the sync step's
and staleness gate's holding of rows; the latency, which is what was measured to matter, is
the same. Kept for later: the request kinds here are the existing ``push_rows``, checked by the
shard as before (:mod:`tensorfleet.ps.table_requests`).

Failures: a row reply that fails because a ps restarted, fell silent or timed out is
recovered from as an immediate row push is (the rows are dropped, never sent twice); when the
dense exchange already recovered (the requests are forgotten by the new connection), the rows
are counted as dropped without a second recovery. A refusal (``RemoteError``: a bad id or
gradient) is raised by :meth:`settle`, naming the shard's reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tensorfleet.wire.channel import Reply
from tensorfleet.worker.client import RECOVERABLE
from tensorfleet.worker.shard_fanout import ShardFanout


@dataclass
class RowsInFlight:
    """The row pushes sent during one step and not yet awaited: ``(fanout, shard, request id,
    timeout)`` each, in the order sent."""

    sent: list[tuple[ShardFanout, int, int, float]] = field(default_factory=list)

    def add(self, fanout: ShardFanout, shard: int, request_id: int, timeout_s: float) -> None:
        """A row push sent to ``shard`` through ``fanout`` as request ``request_id``."""
        self.sent.append((fanout, shard, request_id, timeout_s))

    def settle(
        self,
        current: Callable[[], ShardFanout],
        recover: Callable[[Exception], None] | None,
    ) -> int:
        """Wait for every reply; returns how many pushes were dropped by a recovery (0 or 1:
        once one fails, the others were lost with it). ``current()``: the client's fan-out
        now (another one, or a channel that forgot the request: the dense exchange already
        recovered, and the rows are dropped with its step). Without ``recover`` a recoverable
        failure is raised."""
        sent, self.sent = self.sent, []
        for fanout, shard, request_id, timeout_s in sent:
            if current() is not fanout or not fanout.channels[shard].knows(request_id):
                return 1  # lost in the dense exchange's recovery: dropped with its step
            try:
                reply: Reply = fanout.wait(shard, request_id, timeout_s)
            except RECOVERABLE as exc:
                if recover is None:
                    raise
                recover(exc)  # never sent twice: the rows are dropped
                return 1
            del reply  # the reply body says nothing more than that the rows were taken
        return 0

    def abandon(self) -> None:
        """Forget the pushes in flight (the step failed with an error that is not recovered
        from: its replies no longer matter)."""
        self.sent = []
