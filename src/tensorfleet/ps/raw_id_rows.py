"""One ps shard's part of a table of raw int64 ids: a row per admitted id, never shared,
with frequency admission and expiry (``EmbeddingTable(..., ids="raw")``).

A hashed table maps ids onto a fixed number of rows, so distinct ids collide. Here every
id the shard admits gets a row of its own (Monolith's collisionless table, DeepRec's
EmbeddingVariable, TorchRec's ZCH): the id's shard is ``splitmix64(id) mod n``
(:class:`~tensorfleet.ps.row_partition.RowPartition`, scheme ``hash``) and the shard keeps
an id -> row map.

**The map, vectorised.** ``keys`` is the ascending int64 tensor of every id the shard knows
(admitted, or counted toward admission), with parallel tensors ``count`` (the updates that
carried the id), ``last_seen`` (the table's update count at its last lookup or update) and
``position`` (its row in the storage tensors, -1 while not admitted). A lookup is one
``torch.searchsorted``; new ids are merged in without a sort (each key's new place is its
old place plus the number of new keys below it, both from ``searchsorted``); removal is one
boolean mask. No Python object per id: millions of ids per shard cost 32 B each in the map.
The rows (``values``, one tensor per optimizer slot) are dense ``[capacity, dim]`` tensors
that grow by doubling up to the shard's share of ``num_rows`` (the table's capacity).

**The clock** is the table's update count on the shard (:attr:`RawIdRowStore.step`): one
update per step (a sync step, or each worker's push in async training, empty parts
included), so it counts global steps.

**Admission** (``admit_after=N``). N = 0: an id gets its row at its first lookup, from the
initializer, like a hashed table's row. N >= 1: a lookup of an id without a row returns
zeros and changes nothing; each update that carries the id adds 1 to its count and drops its
gradient (counted in ``dropped_rows``: it was computed from the zeros, not from a row); the
update that brings the count to N creates the row (from the initializer, slots at their
initial value), and the next lookup reads it. Counting updates, not lookups, makes a sync
step of several workers (one update with the union of their rows) count an id once, as one
process on the whole batch does: so sync training equals one process bit for bit.

**Admission in a fixed amount of memory** (``admission_filter=tfl.AdmissionFilter(...)``):
the counts toward admission live in a counting Bloom filter instead of the map
(:mod:`tensorfleet.ps.admission_filter`), which then holds only ids with rows; an id is
admitted by its N-th update at the latest (earlier only on a filter's false positive), and
keeps its count when its row expires.

**Expiry** (``expire_after_steps=T``). After each update, every id whose ``last_seen`` is T
or more updates old is evicted: its row, its optimizer slots and its count, all at once (its
next appearance starts from zero). Eviction runs inside the update, which the ps applies in
its one request loop (sync: in the step's update; async: in a push's), so no push is ever
applied halfway through an eviction. A push that carries an id evicted after the worker
looked it up finds no row: its gradient is dropped and counted like a not-yet-admitted id's,
and counts toward the id's admission again.

**Capacity.** A shard holds at most its share of ``num_rows`` rows (``ceil(num_rows / n)``),
which ``--max-memory`` counts. An id due for admission while the shard is full keeps its
count and is admitted by the first update that carries it once rows have expired
(``deferred`` counts these). Ids still counting toward admission are in the map only (32 B
each), forgotten by expiry like rows.

**Checkpoints** (:meth:`RawIdRowStore.encode`): the rows as a row store's document holds
them (``ids`` ascending, ``values``, ``slot/<name>``) plus ``keys``, ``count`` and
``last_seen`` (every known id, ascending), ``admission_filter`` (its counters, when the
table has one) and the counters in the metadata; :meth:`decode`
rebuilds exactly that state (the storage order is the ids' order, which nothing reads).
Each id of the map is also marked with the store's ``save_clock`` when it changes, so that
a delta checkpoint holds only the ids changed since an earlier one
(:mod:`tensorfleet.ps.table_deltas`).
"""

from __future__ import annotations

import json
import secrets

import torch
from safetensors.torch import load as safetensors_load

from tensorfleet.errors import CheckpointError, ConfigError
from tensorfleet.ps.admission_filter import CountingFilter
from tensorfleet.ps.raw_id_documents import COUNTERS, RawIdDocuments
from tensorfleet.ps.row_partition import HASH, RowPartition, TableSpec
from tensorfleet.ps.row_store import METADATA_KEY, TABLE_FORMAT, RowStore, _read_metadata
from tensorfleet.ps.save_clock import SaveClock
from tensorfleet.ps.sparse_rows import (
    SparseGradientError,
    SparseRows,
    check_row_shapes,
    check_sparse_rows,
)
from tensorfleet.ps.sparse_update_rules import SparseRowRule

#: Bytes per id in the map: its key, count, last_seen and position (int64 each).
MAP_ENTRY_BYTES = 32
_INITIAL_CAPACITY = 1024


class RawIdRowStore(RawIdDocuments, SaveClock):
    """Shard ``shard`` of a table of raw ids ``table`` (``table.raw_ids``), updated by
    ``rule``; the same methods as :class:`~tensorfleet.ps.row_store.RowStore`."""

    given = False
    version = 0

    def __init__(
        self, table: TableSpec, partition: RowPartition, shard: int, rule: SparseRowRule
    ) -> None:
        if not table.raw_ids or partition.scheme != HASH:
            raise ConfigError(
                f"table {table.name!r}: a store of raw ids needs a table of raw ids split by "
                f"hash, got raw_ids={table.raw_ids} and partition {partition.scheme!r}"
            )
        partition.check_store(table, shard)
        self.table, self.partition, self.shard, self.rule = table, partition, shard, rule
        self.step = 0
        """Updates applied (empty ones included): the clock of admission and expiry."""
        self.local_rows = partition.rows_on(shard)
        """The most rows this shard holds at once (its share of the capacity)."""
        self.incarnation = secrets.randbits(62)
        empty = torch.empty(0, dtype=torch.int64)
        self._keys, self._count, self._seen, self._pos = empty, empty, empty, empty
        self._marks = empty  # per key: the save_clock when its entry or row last changed
        self.save_clock = 0
        self._saved = False
        """Documents written so far (a delta since one holds the ids marked after it)."""
        self._ids = empty  # storage position -> id
        self._values = torch.empty((0, table.dim), dtype=table.torch_dtype)
        self._slots = {name: self._values.clone() for name in rule.slot_names}
        self.size = 0
        """Rows live (admitted, not evicted)."""
        self.filter = (
            None
            if table.admission_filter is None
            else CountingFilter.sized(table.admission_filter, partition.num_shards)
        )
        """Counts toward admission, when the table has a filter (else exact, in the map)."""
        self.counters = dict.fromkeys(COUNTERS, 0)
        """``admitted`` and ``evicted`` rows, ``forgotten`` counts (ids evicted before their
        admission), ``dropped_rows`` (gradient rows of ids without a row), ``deferred``
        (admissions put off because the shard was full), since the table was created."""

    # -- reads -------------------------------------------------------------------------------

    def pull(
        self, ids: torch.Tensor, *, trusted: bool = False, read_only: bool = False
    ) -> torch.Tensor:
        """The rows of ``ids`` (raw ids of this shard, 1-D int64), zeros for an id without a
        row (``admit_after`` 0: created now, while the shard has room); marks them seen.
        ``trusted``: the table in this process split the ids by shard: not scanned again.
        ``read_only``: a lookup nothing will be trained on (an evaluation's, under
        ``no_grad`` or ``eval()``): it changes nothing (:meth:`_read_only`)."""
        if not trusted:
            self._check_ids(ids)
        if read_only:
            return self._read_only(ids)
        index, found = self._find(ids)
        if self.table.admit_after == 0 and ids.numel():
            has_row = found.clone()
            has_row[found] = self._pos[index[found]] >= 0
            if not bool(has_row.all()):
                without = torch.unique(ids[~has_row])
                self._insert(without[~self._find(without)[1]])
                self._admit(without)
                index, found = self._find(ids)
        if bool(found.all()):  # the common case: every id known
            self._seen[index] = self.step
            self._marks[index] = self._change_clock()
            positions = self._pos[index]
            if bool((positions >= 0).all()):
                return self._values.index_select(0, positions)
        out = torch.zeros((ids.numel(), self.table.dim), dtype=self.table.torch_dtype)
        if bool(found.any()):
            where = index[found]
            self._seen[where] = self.step
            self._marks[where] = self._change_clock()
            positions = self._pos[where]
            has_row = positions >= 0
            rows = torch.nonzero(found).flatten()[has_row]
            out[rows] = self._values.index_select(0, positions[has_row])
        return out

    def _read_only(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` as a lookup would give them, creating none and marking none
        seen: an evaluation does not keep rows from expiring, nor add to a delta. An id
        without a row reads zeros, or with ``admit_after`` 0 the initializer's values (what
        its row would start from)."""
        positions = self._positions(*self._find(ids))
        has_row = positions >= 0
        if bool(has_row.all()):
            return self._values.index_select(0, positions)
        out = torch.zeros((ids.numel(), self.table.dim), dtype=self.table.torch_dtype)
        out[has_row] = self._values.index_select(0, positions[has_row])
        if self.table.admit_after == 0:
            out[~has_row] = self.table.initializer.rows(
                ids[~has_row], self.table.dim, self.table.torch_dtype, raw_ids=True
            )
        return out

    def created_rows(self) -> torch.Tensor:
        """The ids that have a row now, ascending."""
        return torch.sort(self._ids[: self.size]).values

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, values)`` of every row, ids ascending (no lookup: nothing marked seen)."""
        order = torch.argsort(self._ids[: self.size])
        return self._ids[: self.size][order], self._values[: self.size][order]

    @property
    def nbytes(self) -> int:
        """Bytes held now: the rows' storage (capacity), slots, ids, and the map."""
        row = self.table.row_bytes * (1 + len(self._slots))
        held = self._values.shape[0] * (row + 8) + self._keys.numel() * MAP_ENTRY_BYTES
        return held + (0 if self.filter is None else self.filter.nbytes)

    @property
    def complete(self) -> bool:
        """Always: rows are created on admission, never sent."""
        return True

    def stats(self) -> dict[str, object]:
        """Rows live, bytes, rule, step, ids counting toward admission and the bytes they
        hold (:attr:`admission_bytes`), and the counters."""
        return {
            "rows_live": self.size,
            "bytes": self.nbytes,
            "rule": self.rule.name,
            "step": self.step,
            "pending": int(self._keys.numel()) - self.size,
            "admission_bytes": self.admission_bytes,
            **self.counters,
        }

    @property
    def admission_bytes(self) -> int:
        """What counting toward admission holds now: the map's entries of ids without rows
        (exact counts), or the filter's counters."""
        if self.filter is not None:
            return self.filter.nbytes
        return (int(self._keys.numel()) - self.size) * MAP_ENTRY_BYTES

    def changed_since(self, *args: object, **kwargs: object) -> None:
        raise SparseGradientError(
            f"table {self.table.name!r} keeps no row versions (a table of raw ids): look "
            f"rows up with pull_rows"
        )

    def fill(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        raise SparseGradientError(
            f"table {self.table.name!r} creates its rows on admission; only a table created "
            f"from given values takes fill_rows"
        )

    # -- updates -----------------------------------------------------------------------------

    def apply(self, gradient: SparseRows, *, trusted: bool = False) -> None:
        """One update: the rule on the ids that have rows; the others counted (and admitted
        at ``admit_after``), their gradient dropped; then expiry (module docstring).
        ``trusted``: made in this process by the table itself, only its shape and dtype are
        checked (as :meth:`tensorfleet.ps.row_store.RowStore.apply`)."""
        self.check(gradient, trusted=trusted)
        self.step += 1
        ids = gradient.indices
        index, found = self._find(ids)
        positions = self._positions(index, found)
        has_row = positions >= 0
        self.rule.apply(
            self._values, self._slots, positions[has_row], gradient.values[has_row], self.step
        )
        without = ids[~has_row]
        if without.numel():
            self.counters["dropped_rows"] += int(without.numel())
            if self.filter is not None:
                self._count_in_the_filter(self.filter, without)
            else:
                self._insert(without[~found[~has_row]])
                where, _ = self._find(without)
                self._count[where] += 1
                due = without[self._count[where] >= self.table.admit_after]
                if due.numel():
                    self._admit(due)
            index, found = self._find(ids)  # the map changed
            if self.filter is not None:  # ids still counting are in the filter, not the map
                index = index[found]
        if ids.numel():
            self._seen[index] = self.step
            self._marks[index] = self._change_clock()
        self._expire()

    def _count_in_the_filter(self, counting: CountingFilter, without: torch.Tensor) -> None:
        """``without`` (ids without rows, none in the map) counted in ``counting``; those
        whose count reached ``admit_after`` get rows, while the shard has room (the others
        keep their count: ``deferred``)."""
        admit_after = self.table.admit_after
        due = without[counting.count(without, admit_after) >= admit_after]
        room = self.local_rows - self.size
        if due.numel() > room:
            self.counters["deferred"] += int(due.numel()) - room
            due = torch.sort(due).values[:room]
        if due.numel():
            self._insert(due)
            self._admit(due)

    def check(self, gradient: SparseRows, *, trusted: bool = False) -> None:
        """Refuse (SparseGradientError) a gradient that does not fit: shape, dtype, ids
        unique and of this shard, finite values; ``trusted`` (made in this process by the
        table itself, :meth:`apply`): its shape and dtype only. Nothing changes before it
        passes."""
        if trusted:
            check_row_shapes(self.table.name, gradient, self.table.dim, self.table.torch_dtype)
            return
        check_sparse_rows(
            self.table.name,
            gradient,
            num_rows=self.table.num_rows,
            dim=self.table.dim,
            dtype=self.table.torch_dtype,
            raw_ids=True,
        )
        self._check_ids(gradient.indices)

    # -- internals ---------------------------------------------------------------------------

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise SparseGradientError(
                f"table {self.table.name!r}: ids must be a 1-D int64 tensor, got {ids.dtype} "
                f"{list(ids.shape)}"
            )
        if self.partition.num_shards == 1:
            return
        wrong = self.partition.shard_of(ids) != self.shard
        if bool(wrong.any()):
            raise SparseGradientError(
                f"table {self.table.name!r}: id {int(ids[wrong][0])} belongs to shard "
                f"{int(self.partition.shard_of(ids[wrong][:1])[0])}, not to this shard "
                f"{self.shard} (hashed over {self.partition.num_shards}); the worker's "
                f"partition plan differs from the ps's"
            )

    def _find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each id's index in ``keys`` (clamped) and whether it is there."""
        if self._keys.numel() == 0:
            return torch.zeros_like(ids), torch.zeros(ids.shape, dtype=torch.bool)
        index = torch.searchsorted(self._keys, ids).clamp_max_(self._keys.numel() - 1)
        return index, self._keys[index] == ids

    def _positions(self, index: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        """Each id's row in the storage (from :meth:`_find`), -1 where it has none."""
        positions = torch.full_like(index, -1)
        if bool(found.any()):
            positions[found] = self._pos[index[found]]
        return positions

    def _insert(self, new: torch.Tensor) -> None:
        """Merge ids not in the map (unique) into it, count 0, unseen, without a row."""
        if new.numel() == 0:
            return
        new = torch.sort(new).values
        old = self._keys.numel()
        total = old + new.numel()
        below = torch.searchsorted(self._keys, new)  # old keys below each new one
        at_new = below + torch.arange(new.numel())
        # new keys below each old key: those whose insertion point is at or before it
        at_old = torch.arange(old) + torch.bincount(below, minlength=old + 1).cumsum(0)[:old]
        merged = []
        for tensor, fill in ((self._keys, None), (self._count, 0), (self._seen, self.step),
                             (self._pos, -1), (self._marks, self._change_clock())):  # fmt: skip
            out = torch.empty(total, dtype=torch.int64)
            out[at_old] = tensor
            out[at_new] = new if fill is None else fill
            merged.append(out)
        self._keys, self._count, self._seen, self._pos, self._marks = merged

    def _admit(self, due: torch.Tensor) -> None:
        """Give rows to ``due`` (ids in the map without a row), ascending, while there is
        room; the others stay counted (``deferred``)."""
        due = torch.sort(due).values
        room = self.local_rows - self.size
        if due.numel() > room:
            self.counters["deferred"] += int(due.numel()) - room
            due = due[:room]
        if due.numel() == 0:
            return
        start, stop = self.size, self.size + due.numel()
        self._grow(stop)
        self._ids[start:stop] = due
        self._values[start:stop] = self.table.initializer.rows(
            due, self.table.dim, self.table.torch_dtype, raw_ids=True
        )
        for name, slot in self._slots.items():
            slot[start:stop] = self.rule.slot_initial_value(name)
        where, _ = self._find(due)
        self._pos[where] = torch.arange(start, stop, dtype=torch.int64)
        self.size = stop
        self.counters["admitted"] += int(due.numel())

    def _expire(self) -> None:
        """Evict every id not seen in the last ``expire_after_steps`` updates, with its row
        and slots; the rows left are packed in their storage order."""
        limit = self.table.expire_after_steps
        if limit is None or self._keys.numel() == 0:
            return
        old = self._seen <= self.step - limit
        if not bool(old.any()):
            return
        rows = self._pos[old]
        gone = rows[rows >= 0]
        self.counters["evicted"] += int(gone.numel())
        self.counters["forgotten"] += int((rows < 0).sum())
        keep = ~old
        self._keys, self._count = self._keys[keep], self._count[keep]
        self._seen, self._pos = self._seen[keep], self._pos[keep]
        self._marks = self._marks[keep]
        if gone.numel() == 0:
            return
        live = torch.ones(self.size, dtype=torch.bool)
        live[gone] = False
        new_place = torch.cumsum(live, 0) - 1
        size = int(live.sum())
        self._ids[:size] = self._ids[: self.size][live]
        self._values[:size] = self._values[: self.size][live]
        for slot in self._slots.values():
            slot[:size] = slot[: self.size][live]
        has_row = self._pos >= 0
        self._pos[has_row] = new_place[self._pos[has_row]]
        self._values[size : self.size] = 0  # evicted rows and slots do not linger
        for slot in self._slots.values():
            slot[size : self.size] = 0
        self.size = size

    def _grow(self, needed: int) -> None:
        capacity = self._values.shape[0]
        if needed <= capacity:
            return
        new = min(self.local_rows, max(needed, 2 * capacity, _INITIAL_CAPACITY))
        self._ids = _resized(self._ids, new)
        self._values = _resized(self._values, new)
        self._slots = {name: _resized(slot, new) for name, slot in self._slots.items()}


def _resized(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    out = tensor.new_zeros((rows, *tensor.shape[1:]))
    out[: tensor.shape[0]] = tensor
    return out


def decode_store(document: bytes, *, expect: TableSpec | None = None) -> RowStore | RawIdRowStore:
    """The store of a table document: a row store's, or a table of raw ids' (by its spec)."""
    try:
        meta = json.loads(_read_metadata(document)[METADATA_KEY])
        raw = isinstance(meta, dict) and isinstance(meta.get("table"), dict)
        raw = raw and "raw_ids" in meta["table"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"a table document cannot be read: {exc}") from None
    if not raw:
        return RowStore.decode(document, expect=expect)
    try:
        tensors = safetensors_load(bytes(document))
        if meta.get("format") != TABLE_FORMAT:
            raise ConfigError(f"format {meta.get('format')!r}, this version reads {TABLE_FORMAT}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"a table document cannot be read: {exc}") from None
    return RawIdRowStore.decode_checked(tensors, meta, expect)


def new_store(
    table: TableSpec, partition: RowPartition, shard: int, rule: SparseRowRule
) -> RowStore | RawIdRowStore:
    """The store for ``table``: of raw ids, or of rows."""
    cls = RawIdRowStore if table.raw_ids else RowStore
    return cls(table, partition, shard, rule)
