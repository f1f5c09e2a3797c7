"""A counting Bloom filter for the admission of raw ids: counts toward ``admit_after`` in a
fixed amount of memory, however many distinct ids arrive.

Why. A table of raw ids with ``admit_after=N`` must count how many updates carried each id
that has no row yet. Counted exactly (:mod:`tensorfleet.ps.raw_id_rows`'s map), every id
ever seen costs 32 B in the map until it is admitted or expires, and the map is rebuilt
(a pass over all of it) by every update that brings new ids: a recommender's long tail of
ids seen once or twice (most of them, in click logs) makes the map, not the rows, the
shard's memory and its time. DeepRec's ``CBFFilter`` and Monolith's probabilistic filter
answer this the same way: the counts live in a counting Bloom filter of a size chosen up
front, and the map holds only ids that have rows.

**The filter.** ``m`` one-byte counters and ``k`` positions per id, ``position_i(id) =
(h1 + i * h2) mod m`` for ``i < k`` (Kirsch and Mitzenmacher's double hashing), where
``h1 = splitmix64(id XOR s1)`` and ``h2 = splitmix64(id XOR s2) | 1`` with fixed seeds
``s1``, ``s2`` (other than the shard hash's, so that a shard's ids spread over all
counters). An id's count is the least of its ``k`` counters: never below the number of
updates that carried it, above it only when other ids share all ``k`` of its counters.
Sized for ``expected_ids`` distinct ids counted at once (the table's, spread over its
shards) and a ``false_positive_rate`` ``p``: per shard, with ``n = ceil(expected_ids /
shards)``, ``m = ceil(-n ln p / (ln 2)^2)`` counters and ``k = max(1, round(m / n * ln 2))``
(about 9.6 B and 7 positions per id at ``p = 0.01``, against 32 B per id counted exactly,
and no rebuild: an update touches only its ids' counters).

**The rule** (one error, on one side). An update adds 1 to the counters of each id it
carries that has no row and whose count is still below ``N``; the ids whose count reaches
``N`` get their rows (:meth:`CountingFilter.count`). So an id is admitted by the update that
carries it for the N-th time *at the latest*: never later than with exact counts, earlier
only when its ``k`` counters were all raised by other ids (at most the filter's false
positive rate for an id that was never seen). Counters saturate at 255 (``admit_after``
must be at most 255). Counts are not taken back: an id whose row expires keeps its count
in the filter, so its next update gives it a row again at once (with exact counts it would
count from zero): the filter cannot tell its counters from other ids'. Ids counting toward
admission never expire (the filter has no per-id clock); a filter that has seen many more
distinct ids than it was sized for admits early more often, never late.

Deterministic: the same updates in the same order give the same counters in every process,
so sync training still equals one process bit for bit. The counters are part of the shard's
checkpoint. A delta checkpoint holds only the counters changed since the document written
last (their positions and values: 9 B each), as long as they are fewer than an eighth of
the filter (else, or for a delta since an older document, the whole filter): the filter
keeps the positions it changed since then (:meth:`CountingFilter.changes`), at most the
filter's own size in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorfleet.errors import ConfigError
from tensorfleet.ps.id_hashing import splitmix64

#: The largest count a counter holds (one byte): ``admit_after`` is at most this.
MAX_COUNT = 255
_SEED_1 = np.uint64(0x5851F42D4C957F2D)
_SEED_2 = np.uint64(0x14057B7EF767814F)


@dataclass(frozen=True)
class AdmissionFilter:
    """How a table of raw ids counts toward admission: in a counting Bloom filter sized for
    ``expected_ids`` distinct ids counted at once (the table's whole, over every shard) with
    at most ``false_positive_rate`` of them admitted early (module docstring). Given to
    :class:`~tensorfleet.worker.embedding_table.EmbeddingTable` as ``admission_filter=``."""

    expected_ids: int
    false_positive_rate: float = 0.01

    def __post_init__(self) -> None:
        ids, rate = self.expected_ids, self.false_positive_rate
        if not isinstance(ids, int) or isinstance(ids, bool) or ids < 1:
            raise ConfigError(
                f"AdmissionFilter: expected_ids must be an int >= 1 (the distinct ids counted "
                f"toward admission at once), got {ids!r}"
            )
        if not isinstance(rate, float | int) or isinstance(rate, bool) or not 0 < rate < 1:
            raise ConfigError(
                f"AdmissionFilter: false_positive_rate must be a number in (0, 1), e.g. 0.01, "
                f"got {rate!r}"
            )

    def shape(self, num_shards: int) -> tuple[int, int]:
        """``(m, k)``: counters and positions per id of each of ``num_shards`` shards."""
        n = -(-self.expected_ids // num_shards)
        counters = math.ceil(-n * math.log(self.false_positive_rate) / math.log(2) ** 2)
        return counters, max(1, round(counters / n * math.log(2)))

    def to_wire(self) -> dict[str, Any]:
        return {
            "expected_ids": self.expected_ids,
            "false_positive_rate": float(self.false_positive_rate),
        }

    @classmethod
    def from_wire(cls, data: object) -> AdmissionFilter:
        if not isinstance(data, dict) or set(data) != {"expected_ids", "false_positive_rate"}:
            raise ConfigError(
                f"an admission filter is a map of expected_ids and false_positive_rate, got "
                f"{data!r:.200}"
            )
        return cls(data["expected_ids"], data["false_positive_rate"])


class CountingFilter:
    """One shard's counters (``counters``: uint8 ``[m]``, the checkpoint's
    ``admission_filter``), ``k`` positions per id."""

    def __init__(self, counters: torch.Tensor, positions: int) -> None:
        self.counters, self.positions = counters, positions
        self._changed: list[torch.Tensor] | None = []
        """Positions changed since :meth:`forget_changes` (None: too many to keep)."""
        self._changed_count = 0

    @classmethod
    def sized(cls, spec: AdmissionFilter, num_shards: int) -> CountingFilter:
        m, k = spec.shape(num_shards)
        return cls(torch.zeros(m, dtype=torch.uint8), k)

    @property
    def nbytes(self) -> int:
        return self.counters.numel()

    def _where(self, ids: torch.Tensor) -> torch.Tensor:
        """``[len(ids), k]`` counter positions of int64 ``ids``."""
        raw = ids.numpy().view(np.uint64)
        h1 = splitmix64(raw ^ _SEED_1)
        h2 = splitmix64(raw ^ _SEED_2) | np.uint64(1)
        steps = np.arange(self.positions, dtype=np.uint64)
        with np.errstate(over="ignore"):
            spots = (h1[:, None] + steps[None, :] * h2[:, None]) % np.uint64(self.counters.numel())
        return torch.from_numpy(spots.astype(np.int64))

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's count (int64): the least of its counters."""
        if ids.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        return self.counters[self._where(ids)].min(dim=1).values.to(torch.int64)

    def count(self, ids: torch.Tensor, up_to: int) -> torch.Tensor:
        """One update carried ``ids`` (unique, without rows): add 1 to the counters of those
        whose count is below ``up_to``, and return every id's count after it."""
        if ids.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        spots = self._where(ids)
        before = self.counters[spots].min(dim=1).values.to(torch.int64)
        counted = spots[before < up_to].flatten()
        if counted.numel():
            where, times = torch.unique(counted, return_counts=True)
            raised = self.counters[where].to(torch.int64) + times
            self.counters[where] = raised.clamp_max_(MAX_COUNT).to(torch.uint8)
            self._note_changed(where)
        return self.counters[spots].min(dim=1).values.to(torch.int64)

    def _note_changed(self, where: torch.Tensor) -> None:
        if self._changed is None:
            return
        self._changed_count += where.numel()
        if self._changed_count * 8 > self.counters.numel():  # more than the filter's bytes
            self._changed = None  # a delta then holds the whole filter
        else:
            self._changed.append(where)

    def changes(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(positions ascending, their counters)`` changed since :meth:`forget_changes`,
        when fewer than an eighth of the counters; None: send the whole filter."""
        if self._changed is None:
            return None
        if not self._changed:
            where = torch.zeros(0, dtype=torch.int64)
        else:
            where = torch.unique(torch.cat(self._changed))
        self._changed, self._changed_count = [where], where.numel()
        return where, self.counters[where]

    def forget_changes(self) -> None:
        """A document holding the counters as they are now was written: changes count
        from here."""
        self._changed, self._changed_count = [], 0
