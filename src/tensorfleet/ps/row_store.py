"""One ps shard's part of an embedding table: its rows, their optimizer slots, and updates.

The shard holds the rows a :class:`~tensorfleet.ps.row_partition.RowPartition` gives it, but
creates each one only when a worker first pulls or pushes it (its initial value comes from
the table's :class:`~tensorfleet.ps.row_initializer.RowInitializer`, a pure function of the
row id, so it does not matter which shard creates it or when). Storage is dense and grows
by doubling: ``values`` and each slot are ``[capacity, dim]`` tensors, ``slot_of[local row]``
is the row's position in them (-1: not created) and ``ids[position]`` the row's global id.
A pull is one ``index_select``; an update is the row-sparse rule on the touched positions.

Every refusal (an id of another shard, out of range, a gradient of the wrong dim or dtype)
happens before any state changes: a bad request loses nothing.

A table created from given values (its initializer's kind is ``given``: the ps's copy of a
``sparse=True`` ``nn.Embedding`` weight, which every worker also holds whole) has no lazy
rows: the chief sends them (:meth:`RowStore.fill`), and until every row of the shard has
arrived (:attr:`RowStore.complete`) a row that is missing is refused. Such a store also
remembers, per row, the version at which it last changed (:attr:`RowStore.version` counts
the fills and the updates that touched rows), so that a worker refreshes its copy with only
the rows changed since the version it last saw (:meth:`RowStore.changed_since`). Versions
are only comparable within one :attr:`RowStore.incarnation` (a random number drawn when the
store is built, and again when it is restored from a checkpoint): a worker that remembers
another incarnation takes every row.

A checkpoint of the store is one safetensors document (:meth:`RowStore.encode`): tensors
``ids`` (the created rows' global ids, ascending), ``values`` and ``slot/<name>`` (the rows in
that order), and the metadata ``tensorfleet_table`` (JSON: format, table spec, partition,
shard, update rule, step count). :meth:`RowStore.decode` checks all of it before building a
store: shapes, dtypes, ids unique, on this shard and in range. The metadata's ``tag``
(``[incarnation, save_clock]``) and each row's mark (:meth:`RowStore.changed_state`) let a
checkpoint hold only the rows changed since an earlier one
(:mod:`tensorfleet.ps.table_deltas`).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from tensorfleet.errors import CheckpointError, ConfigError
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.save_clock import SaveClock
from tensorfleet.ps.sparse_rows import (
    SparseGradientError,
    SparseRows,
    check_row_shapes,
    check_sparse_rows,
    strictly_ascending,
)
from tensorfleet.ps.sparse_update_rules import SparseRowRule

TABLE_FORMAT = 1
METADATA_KEY = "tensorfleet_table"
_INITIAL_CAPACITY = 1024


class RowStore(SaveClock):
    """Shard ``shard`` of table ``table`` cut by ``partition``, updated by ``rule``."""

    def __init__(
        self, table: TableSpec, partition: RowPartition, shard: int, rule: SparseRowRule
    ) -> None:
        partition.check_store(table, shard)
        self.table, self.partition, self.shard, self.rule = table, partition, shard, rule
        self.step = 0
        """Updates applied to the table (empty ones included: torch counts every step)."""
        self.local_rows = partition.rows_on(shard)
        self._slot_of = torch.full((self.local_rows,), -1, dtype=torch.int64)
        self._ids = torch.empty(0, dtype=torch.int64)
        self._values = torch.empty((0, table.dim), dtype=table.torch_dtype)
        self._slots = {name: self._values.clone() for name in rule.slot_names}
        self.size = 0
        """Rows created so far."""
        self.given = table.initializer.kind == "given"
        """Rows come from :meth:`fill`, never from an initializer; each row has a version."""
        self.version = 0
        """Fills and row-touching updates so far (a table of given rows; else always 0)."""
        self.incarnation = secrets.randbits(62)
        """Which store the versions belong to: a new one after a restart or a restore."""
        self._changed_at = torch.empty(0, dtype=torch.int64)
        self._touched_at = torch.empty(0, dtype=torch.int64)
        self.save_clock = 0
        self._saved = False
        self._whole = False
        """Every row of the shard exists at the position of its local index
        (:meth:`create_all`): positions need no lookup."""
        self._pulled: tuple[torch.Tensor, int, torch.Tensor] | None = None
        """The ids of the last pull, their version counter then, and their positions: in
        one process a step's gradient carries the very ids tensor its lookup pulled, whose
        positions need not be looked up again (:meth:`_pulled_positions`).
        Documents written so far: each row's :attr:`touched_at` is the clock when it
        last changed, so a delta since a document of clock ``c`` holds the rows marked
        ``> c``, exactly the ones changed after it."""

    # -- reads -------------------------------------------------------------------------------

    def pull(
        self, ids: torch.Tensor, *, trusted: bool = False, read_only: bool = False
    ) -> torch.Tensor:
        """The current values of rows ``ids`` (global ids of this shard, 1-D int64), created
        on first use: a new ``[len(ids), dim]`` tensor. ``trusted``: the ids were checked
        by the table in this process (range, shard), so they are not scanned again.
        ``read_only`` changes nothing here: a row's values do not depend on when it was
        created, and a table of rows keeps no clock of use (a table of raw ids does)."""
        if not trusted:
            self._check_ids(ids)
        positions = self._positions(ids, create=not self.given)
        self._pulled = (ids, ids._version, positions)
        return self._values.index_select(0, positions)

    def created_rows(self) -> torch.Tensor:
        """The global ids of the rows created so far, ascending."""
        return torch.sort(self._ids[: self.size]).values

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, values)`` of the rows created so far, ids ascending."""
        order = torch.argsort(self._ids[: self.size])
        return self._ids[: self.size][order], self._values[: self.size][order]

    def changed_state(self, since: int) -> dict[str, torch.Tensor]:
        """What a delta since the document of clock ``since`` holds
        (:mod:`tensorfleet.ps.table_deltas`): the rows created, updated or filled after it
        (each row is marked with the :attr:`save_clock` of its last change), as
        :meth:`encode` holds rows: ``ids`` ascending, ``values``, ``slot/<name>``."""
        positions = torch.nonzero(self._touched_at[: self.size] > since).flatten()
        ids = self._ids.index_select(0, positions)
        order = torch.argsort(ids)
        positions = positions[order]
        state = {"ids": ids[order], "values": self._values.index_select(0, positions)}
        for name, slot in self._slots.items():
            state[f"slot/{name}"] = slot.index_select(0, positions)
        return state

    @property
    def nbytes(self) -> int:
        """Bytes held now (capacity, not just created rows), bookkeeping included."""
        row = self.table.row_bytes * (1 + len(self._slots))
        versions = self._changed_at.numel() * 8
        return self._values.shape[0] * (row + 8) + self.local_rows * 8 + versions

    def stats(self) -> dict[str, object]:
        """Rows live, bytes held, the rule and the update count (``cluster_stats()``)."""
        return {
            "rows_live": self.size,
            "bytes": self.nbytes,
            "rule": self.rule.name,
            "step": self.step,
        }

    @property
    def complete(self) -> bool:
        """Whether every row of this shard exists (a table of given rows: all arrived)."""
        return self.size == self.local_rows

    def changed_since(
        self, since: int | None, start: int = 0, max_rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """The rows of a table of given rows that changed after version ``since`` (None:
        every row), scanning storage positions from ``start``, at most ``max_rows`` of them:
        ``(ids, values, next_start)``, ``next_start`` None when the scan reached the end.
        Refused (SparseGradientError) for a lazily created table, or one not filled yet."""
        if not self.given:
            raise SparseGradientError(
                f"table {self.table.name!r} keeps no row versions: only a table created from "
                f"given values (a sparse nn.Embedding weight held as rows) is mirrored whole by "
                f"the workers; look rows up with pull_rows"
            )
        self._require_complete()
        if not 0 <= start <= self.size:
            raise SparseGradientError(
                f"table {self.table.name!r}: scan start {start} is outside [0, {self.size}]"
            )
        if since is None:
            positions = torch.arange(start, self.size, dtype=torch.int64)
        else:
            changed = self._changed_at[start : self.size] > since
            positions = torch.nonzero(changed).flatten().add_(start)
        next_start = None
        if max_rows is not None and positions.numel() > max_rows:
            next_start = int(positions[max_rows])
            positions = positions[:max_rows]
        ids = self._ids.index_select(0, positions)
        return ids, self._values.index_select(0, positions), next_start

    # -- updates -----------------------------------------------------------------------------

    def apply(self, gradient: SparseRows, *, trusted: bool = False) -> None:
        """One update of the table with this shard's rows of a step's gradient (an empty
        ``gradient`` still counts as a step: see :mod:`tensorfleet.ps.sparse_update_rules`).

        ``trusted``: the gradient was made in this process by the table itself
        (:meth:`~tensorfleet.worker.local_row_source.LocalRowSource.push_own_rows`), so only
        its shape and dtype are checked (no scan of its ids for range, shard and uniqueness,
        nor of its values for NaN): the checks that exist because a peer's bytes cannot be
        trusted. A gradient received from a worker is always checked in full."""
        self.check(gradient, trusted=trusted)
        positions = self._pulled_positions(gradient.indices)
        if positions is None:
            positions = self._positions(gradient.indices, create=True)
        self.step += 1
        self.rule.apply(self._values, self._slots, positions, gradient.values, self.step)
        self._touched_at.index_fill_(0, positions, self._change_clock())
        if self.given and gradient.num_rows:
            self.version += 1
            self._changed_at[positions] = self.version

    def fill(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Set rows ``ids`` (of this shard, unique) of a table of given rows to ``values``,
        creating them, their optimizer slots at their initial value. Refused (nothing
        changed) for a lazily created table, for a table whose rows have all arrived (a fill
        would overwrite trained rows), and for ids or values that do not fit."""
        name = self.table.name
        if not self.given:
            raise SparseGradientError(
                f"table {name!r} creates its rows from its initializer "
                f"({self.table.initializer.kind}); only a table created from given values "
                f"takes fill_rows"
            )
        if ids.numel() == 0:
            return
        if self.complete:
            raise SparseGradientError(
                f"table {name!r} on shard {self.shard} has all its rows already: a fill would "
                f"overwrite rows that may have trained; the chief fills a table only while it "
                f"is incomplete (table_create answers whether it is)"
            )
        self._check_ids(ids)
        if values.dtype != self.table.torch_dtype or tuple(values.shape) != (
            ids.numel(),
            self.table.dim,
        ):
            raise SparseGradientError(
                f"table {name!r} is {self.table.torch_dtype} [rows, {self.table.dim}]; the "
                f"fill carries {values.dtype} {list(values.shape)} for {ids.numel()} ids; fix: "
                f"send the rows of the weight the table was created for"
            )
        if torch.unique(ids).numel() != ids.numel():
            raise SparseGradientError(f"table {name!r}: the ids of a fill repeat")
        local = self.partition.local_of(ids)
        missing = self._slot_of[local] < 0
        if bool(missing.any()):
            new_ids = ids[missing]
            start = self.size
            self._grow(start + new_ids.numel())
            self._ids[start : start + new_ids.numel()] = new_ids
            self._slot_of[self.partition.local_of(new_ids)] = torch.arange(
                start, start + new_ids.numel(), dtype=torch.int64
            )
            self.size = start + new_ids.numel()
        positions = self._slot_of[local]
        self._values[positions] = values
        for slot_name, slot in self._slots.items():
            slot[positions] = self.rule.slot_initial_value(slot_name)
        self.version += 1
        self._changed_at[positions] = self.version
        self._touched_at[positions] = self._change_clock()

    def check(self, gradient: SparseRows, *, trusted: bool = False) -> None:
        """Refuse (SparseGradientError) a gradient that does not fit this shard's part of
        the table: its shape, dtype, ids (in range, unique, of this shard), finite values;
        ``trusted`` (made in this process by the table itself, :meth:`apply`): its shape
        and dtype only."""
        if trusted:
            check_row_shapes(self.table.name, gradient, self.table.dim, self.table.torch_dtype)
        else:
            check_sparse_rows(
                self.table.name,
                gradient,
                num_rows=self.table.num_rows,
                dim=self.table.dim,
                dtype=self.table.torch_dtype,
            )
            self._check_ids(gradient.indices)
        if self.given and gradient.num_rows:
            self._require_complete()

    def _require_complete(self) -> None:
        if not self.complete:
            raise SparseGradientError(
                f"table {self.table.name!r} on shard {self.shard} has {self.size:,d} of its "
                f"{self.local_rows:,d} rows: the chief has not sent them all (fill_rows); it "
                f"fills the table when training starts, before the other workers may use it"
            )

    # -- checkpoints -------------------------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        """The metadata of this store's documents: format, table, partition, shard, rule,
        step, and ``tag`` (``[incarnation, save_clock]``: what a delta is made since)."""
        return {
            "format": TABLE_FORMAT,
            "table": self.table.to_wire(),
            "partition": self.partition.to_manifest(),
            "shard": self.shard,
            "rule": self.rule.to_wire(),
            "step": self.step,
            "tag": [self.incarnation, self.save_clock],
        }

    def encode(self) -> bytes:
        """This shard's part of the table as a safetensors document (module docstring)."""
        order = torch.argsort(self._ids[: self.size])
        tensors = {
            "ids": self._ids[: self.size][order].contiguous(),
            "values": self._values[: self.size][order].contiguous(),
        }
        for name, slot in self._slots.items():
            tensors[f"slot/{name}"] = slot[: self.size][order].contiguous()
        document = safetensors_save(tensors, {METADATA_KEY: json.dumps(self.metadata())})
        self.note_saved()
        return document

    @classmethod
    def decode(cls, document: bytes, *, expect: TableSpec | None = None) -> RowStore:
        """A store from :meth:`encode`'s document, checked (CheckpointError naming the
        problem); ``expect``: the table the caller holds, which the document must match."""
        try:
            tensors = safetensors_load(bytes(document))
            header = _read_metadata(document)
            meta = json.loads(header[METADATA_KEY])
            if meta.get("format") != TABLE_FORMAT:
                raise ConfigError(
                    f"format {meta.get('format')!r}, this version reads {TABLE_FORMAT}"
                )
            table, partition, rule, shard, step = table_document_fields(meta)
            store = cls(table, partition, shard, rule)
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"a table document cannot be read: {exc}") from None
        name = table.name
        check_table_matches(table, expect)
        want = {"ids", "values", *(f"slot/{s}" for s in rule.slot_names)}
        if set(tensors) != want:
            raise CheckpointError(
                f"table {name!r} shard {shard}: the document holds {sorted(tensors)}, expected "
                f"{sorted(want)}"
            )
        ids = tensors["ids"]
        rows = ids.shape[0] if ids.dim() == 1 else -1
        if ids.dtype != torch.int64 or rows < 0:
            raise CheckpointError(
                f"table {name!r}: ids must be int64 [n], got {ids.dtype} {list(ids.shape)}"
            )
        for key in want - {"ids"}:
            t = tensors[key]
            if t.dtype != table.torch_dtype or tuple(t.shape) != (rows, table.dim):
                raise CheckpointError(
                    f"table {name!r}: {key} is {t.dtype} {list(t.shape)}, expected "
                    f"{table.torch_dtype} {[rows, table.dim]}"
                )
        if rows:
            if torch.unique(ids).numel() != rows:
                raise CheckpointError(f"table {name!r} shard {shard}: the row ids repeat")
            if int(ids.min()) < 0 or int(ids.max()) >= table.num_rows:
                raise CheckpointError(f"table {name!r} shard {shard}: a row id is out of range")
            if bool((partition.shard_of(ids) != shard).any()):
                raise CheckpointError(
                    f"table {name!r}: the document of shard {shard} holds rows of another shard"
                )
        store._grow(rows)
        store._ids[:rows] = ids
        store._values[:rows] = tensors["values"]
        for slot in rule.slot_names:
            store._slots[slot][:rows] = tensors[f"slot/{slot}"]
        store._slot_of[partition.local_of(ids)] = torch.arange(rows, dtype=torch.int64)
        store.size, store.step = rows, step
        return store

    # -- internals ---------------------------------------------------------------------------

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise SparseGradientError(
                f"table {self.table.name!r}: row ids must be a 1-D int64 tensor, got "
                f"{ids.dtype} {list(ids.shape)}"
            )
        if ids.numel() == 0:
            return ids
        low, high = torch.aminmax(ids)
        if int(low) < 0 or int(high) >= self.table.num_rows:
            bad = ids[(ids < 0) | (ids >= self.table.num_rows)]
            raise SparseGradientError(
                f"table {self.table.name!r}: row id {int(bad[0])} is out of range "
                f"[0, {self.table.num_rows}); fix: hash unbounded ids into the table "
                f"(hash_ids=True) or make num_rows larger"
            )
        if self.partition.num_shards == 1:
            return ids  # in range: this one shard holds every row
        wrong = self.partition.shard_of(ids) != self.shard
        if bool(wrong.any()):
            row = int(ids[wrong][0])
            raise SparseGradientError(
                f"table {self.table.name!r}: row {row} belongs to shard "
                f"{int(self.partition.shard_of(ids[wrong][:1])[0])}, not to this shard "
                f"{self.shard} ({self.partition.scheme} over {self.partition.num_shards}); the "
                f"worker's partition plan differs from the ps's"
            )
        return ids

    def _pulled_positions(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The positions of ``ids`` if it is the tensor the last pull looked up, unchanged
        since (the same object, its in-place version counter the same; a row never moves
        once created, so they still hold), else None."""
        pulled = self._pulled
        if pulled is not None and pulled[0] is ids and ids._version == pulled[1]:
            return pulled[2]
        return None

    def _positions(self, ids: torch.Tensor, create: bool) -> torch.Tensor:
        local = self.partition.local_of(ids)
        if self._whole:  # every row created in order: a row's position is its local index
            return local
        positions = self._slot_of.index_select(0, local)
        missing = positions < 0
        any_missing = bool(missing.any())
        if self.given and any_missing:
            self._require_complete()  # refused: a given table's rows exist once filled
        if create and any_missing:
            new_ids = ids[missing]
            if not strictly_ascending(new_ids):  # a pull may repeat an id; a table's never
                new_ids = torch.unique(new_ids)
            start = self.size
            self._grow(start + new_ids.numel())
            stop = start + new_ids.numel()
            self._ids[start:stop] = new_ids
            self._values[start:stop] = self.table.initializer.rows(
                new_ids, self.table.dim, self.table.torch_dtype
            )
            for name, slot in self._slots.items():
                slot[start:stop] = self.rule.slot_initial_value(name)
            self._touched_at[start:stop] = self._change_clock()
            self._slot_of[self.partition.local_of(new_ids)] = torch.arange(
                start, stop, dtype=torch.int64
            )
            self.size = stop
            positions = self._slot_of.index_select(0, local)
        return positions

    def create_all(self, chunk: int = 1 << 16) -> int:
        """Create every row of the shard not created yet (the values :meth:`pull` would
        create them with, ``chunk`` rows at a time), so that no step creates rows; returns
        how many it created (0: every row existed already). See :meth:`create_rows`."""
        if not self.given:
            self._grow(self.local_rows)  # the whole table's memory at once, not by doublings
        return sum(
            self.create_rows(start, min(start + chunk, self.local_rows))
            for start in range(0, self.local_rows, chunk)
        )

    def create_rows(self, start: int, stop: int) -> int:
        """Create the rows of local indices ``[start, stop)`` that do not exist yet, as their
        first lookup would (the same values: the initializer is a pure function of the row
        id); rows that exist keep their values and slots. Returns how many it created.

        Why a range: creating a million rows of 8 takes about 0.6 CPU seconds, and a ps
        answers nothing else meanwhile; a client creates a large table a range per request,
        so that the shard serves the other workers between them
        (:meth:`~tensorfleet.worker.ps_row_source.PsRowSource.create_all_rows`).

        A store whose every row was created in local order, from empty (one
        :meth:`create_all`, or ranges in ascending order before any lookup), holds each row
        at the position of its local index: its positions then need no lookup (the fast path
        of :meth:`_positions`). Refused, nothing changed: a table of given rows (they come
        from :meth:`fill`) and a range outside the shard."""
        if self.given:
            raise SparseGradientError(
                f"table {self.table.name!r} takes given rows (fill_rows): it has no rows to "
                f"create from an initializer; fix: drop the create_all_rows() call"
            )
        if not 0 <= start <= stop <= self.local_rows:
            raise SparseGradientError(
                f"table {self.table.name!r}: rows [{start}, {stop}) to create are outside "
                f"shard {self.shard}'s local rows [0, {self.local_rows})"
            )
        if self._whole or start == stop:
            return 0
        local = torch.arange(start, stop, dtype=torch.int64)
        if self.size:  # only the missing ones
            local = local[self._slot_of[start:stop] < 0]
        if local.numel():
            self._positions(self.partition.global_of(self.shard, local), create=True)
        if self.size == self.local_rows and bool(
            torch.equal(self._slot_of, torch.arange(self.local_rows, dtype=torch.int64))
        ):
            self._whole = True  # each row at its local index, as created in order
        return int(local.numel())

    def _grow(self, needed: int) -> None:
        capacity = self._values.shape[0]
        if needed <= capacity:
            return
        new = min(self.local_rows, max(needed, 2 * capacity, _INITIAL_CAPACITY))
        self._ids = _resized(self._ids, new)
        self._values = _resized(self._values, new)
        self._slots = {name: _resized(slot, new) for name, slot in self._slots.items()}
        self._touched_at = _resized(self._touched_at, new)
        if self.given:
            self._changed_at = _resized(self._changed_at, new)


def _resized(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    out = tensor.new_zeros((rows, *tensor.shape[1:]))
    out[: tensor.shape[0]] = tensor
    return out


def _read_metadata(document: bytes) -> dict[str, Any]:
    """The ``__metadata__`` map of a safetensors document (already parsed by safetensors)."""
    length = int.from_bytes(bytes(document[:8]), "little")
    header = json.loads(bytes(document[8 : 8 + length]))
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or METADATA_KEY not in metadata:
        raise ConfigError(f"no {METADATA_KEY!r} metadata")
    return metadata


def table_document_fields(
    meta: dict,
) -> tuple[TableSpec, RowPartition, SparseRowRule, int, int]:
    """A table document's table, partition, rule, shard and step, from its metadata
    (ValueError, KeyError or TypeError when one is missing or malformed)."""
    table = TableSpec.from_wire(meta["table"])
    partition = RowPartition.from_manifest(meta["partition"])
    rule = SparseRowRule.from_wire(meta["rule"])
    shard, step = meta["shard"], meta["step"]
    if not isinstance(shard, int) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"shard {shard!r} and step {step!r} must be ints >= 0")
    return table, partition, rule, shard, step


def check_table_matches(table: TableSpec, expect: TableSpec | None) -> None:
    """CheckpointError unless a document's ``table`` is the one the model has (``expect``;
    None: any)."""
    if expect is not None and expect != table:
        raise CheckpointError(
            f"the checkpoint holds table {table.to_wire()}, the model has "
            f"{expect.to_wire()}; fix: build the table as it was trained, or start without "
            f"this checkpoint"
        )
