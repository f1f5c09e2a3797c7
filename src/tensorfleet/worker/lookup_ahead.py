"""A table's next lookup sent ahead, with the exchange of the step before: the next batch's
rows travel while the worker waits for this step's replies, and the next forward finds them
arrived instead of asking and waiting.

What: ``table.prefetch(ids)`` (:meth:`~tensorfleet.worker.embedding_table.EmbeddingTable.prefetch`)
says that the table's first lookup after the next step's exchange will be of ``ids``. That
exchange asks every shard holding some of their rows for them (``pull_rows``, the request a
lookup makes) without waiting for the answers, and that lookup takes the answers
(:class:`LookupAhead` holds the one prefetched and the one sent; :class:`SentLookup` the
requests in flight, sent and received by
:class:`~tensorfleet.worker.ps_row_source.PsRowSource`).

When the exchange sends it, so that the rows are the ones the lookup would have read:

* **async training** (no ``max_staleness``): a shard applies a row push at once, and answers
  one channel's requests in order. The lookup goes right behind the step's row pushes, on the
  same channels, before the dense gradients: its rows carry this worker's update of the step,
  and its round trip runs beside the dense exchange's. One wait a step less.
* **sync training, and async with** ``max_staleness``: a shard holds a push's rows (for the
  step's mean, or until the staleness gate releases the push) and applies them later; the
  lookup goes at the very end of the exchange, which is where the next forward would have
  sent it (nothing that writes rows goes between), so the rows are the same, bit for bit.
  Its round trip then runs beside whatever the script does between two steps (building the
  next batch, the hooks).

What a forward does with it: a lookup sent ahead is taken by the table's first lookup after
the exchange that sent it; with the same ids (after hashing, in the same order: the unique
ids and the batch's places among them were worked out by ``prefetch`` and are not again) its
answers are the rows (``used``); with other ids they are awaited, dropped, and the lookup asks
for its own (``missed``: one round trip wasted; two in a row are warned about, once); when a recovery since then
lost the requests, the lookup asks again (``lost``). The prefetch of a run's last step is
missed by design (by an evaluation after the loop, or by nobody). A lookup of exactly the ids prefetched,
made before any exchange sent them (``prefetch`` called after the step instead of before it),
takes the prefetch back: nothing is sent twice. The counts are
:attr:`~tensorfleet.worker.embedding_table.EmbeddingTable.lookups_ahead`.

Why: on 2 ps + 2 workers the click model's step waited twice, for the lookup and for the
exchange's replies, each a round trip to shards that share two cores with the workers
(docs/sparse.md, "Fewer waits per step"); the lookup's wait was the larger part of a step.
Only the script knows the next batch's ids before its forward, so it says them. Measured
(``benchmarks/sparse_tables.py --parts click --click-modes cluster cluster_prefetch``,
2026-11-28, docs/sparse.md): the lookup's wait in a step went from about 4 ms to 0.7 ms, but
on the 2-core machine most of that time reappeared in the exchange (examples/s 0.87x-1.18x:
the wait was the processes' CPU time handling messages on two busy cores, not idle time on
a link); the round trip it hides is worth most where the shards are on other hosts.

The alternative: TorchRec's ``TrainPipelineSparseDist`` owns the training loop, takes the
data loader and distributes the next batch's ids during the current step. That fits a loop
the library writes; a ``TrainingSession`` keeps the script's own loop (``sess.step(closure)``),
so one call names the ids instead. In one process (``LocalRowSource``) the rows are in memory
and ``prefetch`` does nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tensorfleet.worker.shard_fanout import ShardFanout

log = logging.getLogger("tensorfleet.worker")


@dataclass(frozen=True)
class SentLookup:
    """The ``pull_rows`` requests of a lookup sent ahead: ``requests[k]`` is the request id on
    shard ``k`` of ``fanout`` asking for the rows of ``ids[k]`` of table ``table``."""

    table: str
    fanout: ShardFanout
    ids: dict[int, torch.Tensor]
    requests: dict[int, int]


@dataclass
class LookupAhead:
    """A lookup prefetched, worked out once: the batch's ids as the forward will look them up
    (``flat``: after hashing, flattened), their unique values (ascending) and where each id
    is among them (``inverse``), each shard's part of them (``parts``) and where its rows go
    (``places``); once an exchange sent it, its requests (``asked``)."""

    flat: torch.Tensor
    unique: torch.Tensor
    inverse: torch.Tensor
    places: dict[int, torch.Tensor]
    parts: dict[int, torch.Tensor]
    asked: SentLookup | None = None


@dataclass
class LookupsAhead:
    """One table's lookups sent ahead: the one prefetched for the next exchange (``next``),
    the one that exchange sent (``sent``), and what became of them (``counts``)."""

    next: LookupAhead | None = None
    sent: LookupAhead | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"used": 0, "missed": 0, "lost": 0})
    _missed_in_a_row: int = 0
    _warned: bool = False

    def used(self) -> None:
        """The next lookup took the rows sent ahead."""
        self.counts["used"] += 1
        self._missed_in_a_row = 0

    def missed(self, table_label: str) -> None:
        """A lookup sent ahead was not of the ids looked up: count it, and the second time in
        a row (a script that prefetches the wrong batch; the last prefetch of a run, not
        followed by its step, is missed once) say what to do, once (``table_label`` names
        the table)."""
        self.counts["missed"] += 1
        self._missed_in_a_row += 1
        if self._missed_in_a_row >= 2 and not self._warned:
            self._warned = True
            log.warning(
                "%s: the rows prefetched were not those of its next lookup (other ids), so "
                "they were dropped and the lookup asked for its own; fix: call "
                "table.prefetch(ids) with the ids of the batch the step AFTER the next "
                "sess.step() looks up, before that sess.step() (docs/sparse.md, 'The next "
                "batch's rows ahead')",
                table_label,
            )

    def clear(self) -> None:
        """Forget both (the session ended: the channels close with their requests)."""
        self.next = self.sent = None
