"""The embedding tables one ps shard holds: created under its memory limit, pulled and
updated by name, saved and restored as one document per table.

This is what the ps's request handler delegates to for the table operations (create, pull
rows, push rows, save, restore); it knows nothing of the wire or of workers. Errors a user
can cause (an unknown table, a table created twice with another shape, ids or gradients that
do not fit, a table over ``--max-memory``) raise :class:`~tensorfleet.errors.TensorfleetError`
subclasses that also derive from ``ValueError``, before any state changes.
"""

from __future__ import annotations

import torch

from tensorfleet.errors import CheckpointError, ConfigError, TensorfleetError
from tensorfleet.ps.memory_budget import check_fits, table_shard_bytes
from tensorfleet.ps.raw_id_rows import MAP_ENTRY_BYTES, RawIdRowStore, decode_store, new_store
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.row_store import RowStore
from tensorfleet.ps.sparse_rows import SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.table_deltas import check_since, table_document


class UnknownTable(TensorfleetError, ValueError):
    """A request names a table this shard does not hold."""


class ShardTables:
    """The tables of shard ``shard`` (of ``num_shards``), limited to ``max_memory`` bytes
    (None: no limit) counted at their full size (:mod:`tensorfleet.ps.memory_budget`)."""

    def __init__(self, shard: int, num_shards: int, max_memory: int | None = None) -> None:
        self.shard, self.num_shards, self.max_memory = shard, num_shards, max_memory
        self._stores: dict[str, RowStore | RawIdRowStore] = {}

    def create(self, table: TableSpec, partition: RowPartition, rule: SparseRowRule) -> bool:
        """Hold this shard's part of ``table``; idempotent for the same table (every worker
        may ask). False when it already existed. Refused: another table under the same name,
        a partition over another number of shards, or a table over the memory limit."""
        existing = self._stores.get(table.name)
        if existing is not None:
            if (existing.table, existing.partition, existing.rule) != (table, partition, rule):
                raise ConfigError(
                    f"table {table.name!r} exists on ps:{self.shard} as "
                    f"{existing.table.to_wire()} ({existing.partition.scheme}, rule "
                    f"{existing.rule.name}); a worker asked for {table.to_wire()} "
                    f"({partition.scheme}, rule {rule.name}); fix: give every worker the same "
                    f"model, or another name to the other table"
                )
            return False
        if partition.num_shards != self.num_shards:
            raise ConfigError(
                f"table {table.name!r} is partitioned over {partition.num_shards} shards, the "
                f"cluster has {self.num_shards} ps tasks"
            )
        check_fits(
            table=table.name,
            shard=self.shard,
            needed_bytes=self.full_bytes(table, partition, rule),
            used_bytes=sum(self.full_bytes(s.table, s.partition, s.rule) for s in self),
            max_bytes=self.max_memory,
            num_shards=self.num_shards,
            raw_ids=table.raw_ids,
        )
        self._stores[table.name] = new_store(table, partition, self.shard, rule)
        return True

    def full_bytes(self, table: TableSpec, partition: RowPartition, rule: SparseRowRule) -> int:
        """The most this shard's part of ``table`` can take (every row created; raw ids:
        its share of the capacity, each row with its id and its entry in the id map, and
        its admission filter; ids counting toward admission exactly are not bounded)."""
        if table.raw_ids:
            per_row = table.row_bytes * (1 + len(rule.slot_names)) + 8 + MAP_ENTRY_BYTES
            held = table.admission_filter
            counters = 0 if held is None else held.shape(partition.num_shards)[0]
            return partition.rows_on(self.shard) * per_row + counters
        return table_shard_bytes(
            partition.rows_on(self.shard),
            table.row_bytes,
            len(rule.slot_names),
            versioned=table.initializer.kind == "given",
        )

    def pull(self, name: str, ids: torch.Tensor, read_only: bool = False) -> torch.Tensor:
        """Rows ``ids`` of table ``name``; ``read_only``: an evaluation's lookup, which
        changes nothing (:meth:`RawIdRowStore.pull`)."""
        return self.store(name).pull(ids, read_only=read_only)

    def apply(self, name: str, gradient: SparseRows, *, trusted: bool = False) -> None:
        """Update table ``name`` with this shard's rows of a step's gradient; ``trusted``:
        made in this process by the table itself (see :meth:`RowStore.apply`)."""
        self.store(name).apply(gradient, trusted=trusted)

    def store(self, name: str) -> RowStore | RawIdRowStore:
        store = self._stores.get(name)
        if store is None:
            raise UnknownTable(
                f"ps:{self.shard} holds no table {name!r} (it holds "
                f"{sorted(self._stores) or 'none'}); the chief creates tables when training "
                f"starts: was this ps restarted without a checkpoint to restore?"
            )
        return store

    def names(self) -> list[str]:
        """The tables this shard holds."""
        return list(self._stores)

    def describe(self, name: str) -> str:
        """One line on table ``name`` for the ps log: its rows here, their bytes, its rule
        (``table 'users': 500,000 of 1,000,000 rows, up to 12,000,000 B, rule adagrad``)."""
        store = self.store(name)
        full = self.full_bytes(store.table, store.partition, store.rule)
        spec = store.table
        if spec.raw_ids:
            return (
                f"table {name!r} of raw ids (admit after {spec.admit_after} updates"
                f"{_counted_in(spec)}, expire after {spec.expire_after_steps or 'no'} steps "
                f"unseen): up to "
                f"{store.local_rows:,d} of its {spec.num_rows:,d} rows live here, up to "
                f"{full:,d} B ({store.nbytes:,d} B held now), rule {store.rule.name}"
            )
        return (
            f"table {name!r}: {store.local_rows:,d} of {spec.num_rows:,d} rows, up to "
            f"{full:,d} B ({store.nbytes:,d} B held now), rule {store.rule.name}"
        )

    def summary(self) -> str:
        """Every table in one clause for the ps log (empty: no tables)."""
        return "; ".join(self.describe(name) for name in self._stores)

    def stats(self) -> dict[str, dict[str, object]]:
        """Each table's numbers for ``cluster_stats()``: rows live, bytes held, rule, step
        (and, for a table of raw ids, admitted and evicted rows, dropped gradients)."""
        return {name: store.stats() for name, store in self._stores.items()}

    def save(self, since: dict[str, object] | None = None) -> dict[str, bytes]:
        """Each table's document, by table name: full (:meth:`RowStore.encode`), or for a
        table ``since`` names with a tag of its store, a delta since that tag
        (:mod:`tensorfleet.ps.table_deltas`)."""
        since = since or {}
        return {
            name: table_document(store, check_since(name, since.get(name)))
            for name, store in self._stores.items()
        }

    def restore(self, documents: dict[str, bytes]) -> None:
        """Replace the tables with a checkpoint's, all or nothing (CheckpointError)."""
        restored = {}
        for name, document in documents.items():
            expect = self._stores[name].table if name in self._stores else None
            store = decode_store(document, expect=expect)
            if store.table.name != name or store.shard != self.shard:
                raise CheckpointError(
                    f"the document for table {name!r} holds table {store.table.name!r} of "
                    f"shard {store.shard}; this is ps:{self.shard}"
                )
            restored[name] = store
        self._stores.update(restored)

    def __iter__(self):
        return iter(self._stores.values())

    def __len__(self) -> int:
        return len(self._stores)


def _counted_in(spec: TableSpec) -> str:
    """Where a table of raw ids counts toward admission, for the log (empty: exactly)."""
    if spec.admission_filter is None:
        return ""
    given = spec.admission_filter
    return (
        f", counted in a filter sized for {given.expected_ids:,d} ids at a "
        f"{given.false_positive_rate:g} false positive rate"
    )
