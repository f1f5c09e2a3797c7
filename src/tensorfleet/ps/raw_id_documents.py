"""The documents of a shard of a table of raw ids: the whole state in id order, a full
checkpoint document, what a delta since an earlier one holds, and a store read back from a
document, checked. A mixin of :class:`~tensorfleet.ps.raw_id_rows.RawIdRowStore` (the store's
role is its map, its rows and their updates; this module's is their documents): the format
is the module docstring's of :mod:`tensorfleet.ps.raw_id_rows` (**Checkpoints**).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save as safetensors_save

from tensorfleet.errors import CheckpointError, ConfigError
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.row_store import (
    METADATA_KEY,
    TABLE_FORMAT,
    check_table_matches,
    table_document_fields,
)
from tensorfleet.ps.sparse_update_rules import SparseRowRule

if TYPE_CHECKING:
    from typing import Self

    from tensorfleet.ps.admission_filter import CountingFilter

#: The counters a store keeps (and its documents carry), in this order.
COUNTERS = ("admitted", "evicted", "forgotten", "dropped_rows", "deferred")


class RawIdDocuments:
    """The documents of a :class:`~tensorfleet.ps.raw_id_rows.RawIdRowStore` (mixed into
    it, which provides the attributes below and ``rows``, ``note_saved``, ``_find`` and
    ``_grow``)."""

    table: TableSpec
    partition: RowPartition
    shard: int
    rule: SparseRowRule
    step: int
    size: int
    local_rows: int
    incarnation: int
    save_clock: int
    counters: dict[str, int]
    filter: CountingFilter | None
    _filter_clock: int | None = None
    """The clock of the document written last, which the filter's changes are since."""
    _keys: torch.Tensor
    _count: torch.Tensor
    _seen: torch.Tensor
    _pos: torch.Tensor
    _marks: torch.Tensor
    _ids: torch.Tensor
    _values: torch.Tensor
    _slots: dict[str, torch.Tensor]

    def state(self) -> dict[str, torch.Tensor]:
        """The whole state in id order (what a checkpoint holds): for comparisons."""
        ids, values = self.rows()
        order = torch.argsort(self._ids[: self.size])
        state = {
            "ids": ids,
            "values": values,
            "keys": self._keys.clone(),
            "count": self._count.clone(),
            "last_seen": self._seen.clone(),
            "step": torch.tensor([self.step]),
        }
        for name, slot in self._slots.items():
            state[f"slot/{name}"] = slot[: self.size][order]
        if self.filter is not None:
            state["admission_filter"] = self.filter.counters.clone()
        return state

    def encode(self) -> bytes:
        """This shard's part as a safetensors document (module docstring)."""
        tensors = {k: v.contiguous() for k, v in self.state().items() if k != "step"}
        document = safetensors_save(tensors, {METADATA_KEY: json.dumps(self.metadata())})
        self.note_saved()
        return document

    def changed_state(self, since: int) -> dict[str, torch.Tensor]:
        """What a delta since the document of clock ``since`` holds: the map entries
        changed after it (looked up, updated, counted, admitted; ``keys``, ``count``,
        ``last_seen``, ascending), the rows of those that have one (``ids``, ``values``,
        ``slot/<name>``), and ``live_keys``, every id in the map now."""
        changed = self._marks > since
        keys = self._keys[changed]
        positions = self._pos[changed]
        has_row = positions >= 0
        rows = positions[has_row]
        state = {
            "keys": keys,
            "count": self._count[changed],
            "last_seen": self._seen[changed],
            "live_keys": self._keys.clone(),
            "ids": keys[has_row],
            "values": self._values.index_select(0, rows),
        }
        for name, slot in self._slots.items():
            state[f"slot/{name}"] = slot.index_select(0, rows)
        if self.filter is not None:
            state.update(self._filter_changes(self.filter, since))
        return state

    def _filter_changes(self, counting: CountingFilter, since: int) -> dict[str, torch.Tensor]:
        """The admission filter's part of a delta since clock ``since``: the counters changed
        since the document written last when it is that one and they are few
        (``admission_filter_at``, ``admission_filter_counts``), else the whole filter."""
        changes = counting.changes() if since == self._filter_clock else None
        if changes is None:
            return {"admission_filter": counting.counters.clone()}
        return {"admission_filter_at": changes[0], "admission_filter_counts": changes[1]}

    def note_saved(self) -> None:
        """A document was written (:class:`~tensorfleet.ps.save_clock.SaveClock`): the
        filter's changes count from it."""
        super().note_saved()  # type: ignore[misc]
        if self.filter is not None:
            self.filter.forget_changes()
            self._filter_clock = self.save_clock

    def metadata(self) -> dict:
        """The metadata of this store's documents: format, table, partition, shard, rule,
        step, counters, and ``tag`` (``[incarnation, save_clock]``: what a delta is made
        since)."""
        return {
            "format": TABLE_FORMAT,
            "table": self.table.to_wire(),
            "partition": {
                "scheme": self.partition.scheme,
                "num_rows": self.partition.num_rows,
                "num_shards": self.partition.num_shards,
            },
            "shard": self.shard,
            "rule": self.rule.to_wire(),
            "step": self.step,
            "counters": dict(self.counters),
            "tag": [self.incarnation, self.save_clock],
        }

    @classmethod
    def decode_checked(
        cls, tensors: dict[str, torch.Tensor], meta: dict, expect: TableSpec | None
    ) -> Self:
        """A store from a document's parsed tensors and metadata (CheckpointError)."""
        try:
            table, partition, rule, shard, step = table_document_fields(meta)
            counters = meta["counters"]
            if not isinstance(counters, dict) or set(counters) != set(COUNTERS):
                raise ConfigError(f"counters {counters!r} must name {COUNTERS}")
            store = cls(table, partition, shard, rule)
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"a table document cannot be read: {exc}") from None
        name = table.name
        check_table_matches(table, expect)
        want = {"ids", "values", "keys", "count", "last_seen"}
        want |= {f"slot/{s}" for s in rule.slot_names}
        want |= set() if store.filter is None else {"admission_filter"}
        if set(tensors) != want:
            raise CheckpointError(
                f"table {name!r} shard {shard}: the document holds {sorted(tensors)}, expected "
                f"{sorted(want)}"
            )
        ids, keys = tensors["ids"], tensors["keys"]
        for key in ("ids", "keys", "count", "last_seen"):
            t = tensors[key]
            if t.dtype != torch.int64 or t.dim() != 1:
                raise CheckpointError(f"table {name!r}: {key} must be int64 [n], got {t.dtype}")
        rows, known = ids.numel(), keys.numel()
        if tensors["count"].numel() != known or tensors["last_seen"].numel() != known:
            raise CheckpointError(f"table {name!r}: count and last_seen must match keys")
        for key in want - {"ids", "keys", "count", "last_seen", "admission_filter"}:
            t = tensors[key]
            if t.dtype != table.torch_dtype or tuple(t.shape) != (rows, table.dim):
                raise CheckpointError(
                    f"table {name!r}: {key} is {t.dtype} {list(t.shape)}, expected "
                    f"{table.torch_dtype} {[rows, table.dim]}"
                )
        if known and not bool((keys[1:] > keys[:-1]).all()):
            raise CheckpointError(f"table {name!r} shard {shard}: keys are not ascending")
        if rows and not bool((ids[1:] > ids[:-1]).all()):
            raise CheckpointError(f"table {name!r} shard {shard}: row ids are not ascending")
        if rows > store.local_rows:
            raise CheckpointError(
                f"table {name!r} shard {shard}: {rows} rows, more than its {store.local_rows}"
            )
        if bool((partition.shard_of(keys) != shard).any()):
            raise CheckpointError(
                f"table {name!r}: the document of shard {shard} holds ids of another shard"
            )
        store._keys, store._count = keys.clone(), tensors["count"].clone()
        store._seen, store._pos = tensors["last_seen"].clone(), torch.full_like(keys, -1)
        store._marks = torch.zeros_like(keys)
        index, found = store._find(ids)
        if not bool(found.all()):
            raise CheckpointError(f"table {name!r} shard {shard}: a row's id is not in keys")
        store._grow(rows)
        store._pos[index] = torch.arange(rows, dtype=torch.int64)
        store._ids[:rows] = ids
        store._values[:rows] = tensors["values"]
        for slot in rule.slot_names:
            store._slots[slot][:rows] = tensors[f"slot/{slot}"]
        store.size, store.step = rows, step
        store.counters = {k: int(counters[k]) for k in COUNTERS}
        if store.filter is not None:
            counts = tensors["admission_filter"]
            if counts.dtype != torch.uint8 or counts.shape != store.filter.counters.shape:
                raise CheckpointError(
                    f"table {name!r} shard {shard}: admission_filter is {counts.dtype} "
                    f"{list(counts.shape)}, expected uint8 {list(store.filter.counters.shape)}"
                )
            store.filter.counters = counts.clone()
        return store
