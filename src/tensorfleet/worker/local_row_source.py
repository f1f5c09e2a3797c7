"""``LocalRowSource``: the rows of embedding tables held in this process, split over shards as
the ps would split them: the :class:`~tensorfleet.worker.embedding_table.RowSource` of
one-process training (a ``TrainingSession`` without a cluster builds one of one shard), and
the reference a cluster's tables must match in the tests.

Its own module because it is a role of its own beside the table: the table
(:mod:`tensorfleet.worker.embedding_table`) looks rows up and pushes their gradient through
whichever source it is attached to; this source applies them to the same row stores a ps
shard keeps (:class:`~tensorfleet.ps.shard_tables.ShardTables`), with the checks a ps makes
for a peer's bytes, or without them for the table's own gradient (``pull_own_rows``,
``push_own_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tensorfleet.errors import ConfigError
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.row_store import RowStore
from tensorfleet.ps.shard_tables import ShardTables
from tensorfleet.ps.sparse_rows import SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule

if TYPE_CHECKING:
    from tensorfleet.worker.embedding_table import EmbeddingTable


class LocalRowSource:
    """The row stores of ``tables`` in this process, split over ``num_shards`` like on the
    ps: one-process training, and the reference the cluster must match. Attaches the tables,
    each created with its own ``rule`` when it has one, else with ``rule`` (default: plain
    ``sgd``). A one-process ``TrainingSession`` builds one itself (``num_shards=1``)."""

    sync_step: int | None = None
    """Unused here (rows are applied at once); a cluster's source names the sync step."""

    def __init__(
        self,
        tables: Sequence[EmbeddingTable],
        num_shards: int = 1,
        rule: SparseRowRule | None = None,
        max_memory: int | None = None,
    ) -> None:
        if rule is not None and not isinstance(rule, SparseRowRule):
            raise ConfigError(
                f"LocalRowSource: rule must be a row-sparse rule such as "
                f"tfl.optim.SparseAdam(lr=0.01) or tfl.optim.SparseRowRule('adagrad', "
                f"{{'lr': 0.1}}), got {type(rule).__name__} {getattr(rule, 'name', '')!s}".rstrip()
                + " (a dense rule such as tfl.optim.SGD is the session's optimizer=, not a table's)"
            )
        self.rule = rule or SparseRowRule("sgd")
        self.shards = [ShardTables(k, num_shards, max_memory) for k in range(num_shards)]
        for table in tables:
            table.attach(self, num_shards)
            self.create(table.spec(), table.partition, table.rule or self.rule)
            table.bound_rule = table.rule or self.rule

    def create(self, table: TableSpec, partition: RowPartition, rule: SparseRowRule) -> None:
        """Hold ``table`` cut by ``partition`` on every local shard (idempotent)."""
        for shard in self.shards:
            shard.create(table, partition, rule)

    def pull_rows(
        self, table: str, shard: int, ids: torch.Tensor, read_only: bool = False
    ) -> torch.Tensor:
        """Rows ``ids`` of ``table`` on ``shard``, the ids checked as a ps checks a pull;
        ``read_only``: an evaluation's lookup, which changes nothing."""
        return self.shards[shard].pull(table, ids, read_only)

    def pull_own_rows(
        self, table: str, shard: int, ids: torch.Tensor, read_only: bool = False
    ) -> torch.Tensor:
        """Rows ``ids`` that :meth:`EmbeddingTable.forward` looks up: their range was
        checked by :meth:`EmbeddingTable.rows_of` (or hashing put them in range) and the
        partition put them on ``shard``, so they are not scanned again."""
        return self.shards[shard].store(table).pull(ids, trusted=True, read_only=read_only)

    def create_all_rows(
        self, table: str, partition: RowPartition | None = None, dim: int | None = None
    ) -> int:
        """Create every row of ``table`` not created yet, on every shard, now, as
        ``nn.Embedding`` does in its constructor; returns how many (see
        :meth:`EmbeddingTable.create_all_rows`; ``partition`` and ``dim`` are the table's,
        which this source knows already)."""
        created = 0
        for shard in self.shards:
            store = shard.store(table)
            if not isinstance(store, RowStore):
                raise ConfigError(
                    f"table {table!r} has ids='raw': it has no fixed set of rows to create "
                    f"ahead (a row is created per id seen); fix: do not call "
                    f"create_all_rows() on it"
                )
            created += store.create_all()
        return created

    def push_rows(self, table: str, parts: Sequence[SparseRows]) -> None:
        """Apply ``parts`` (one per shard), each checked as a ps checks a worker's push."""
        for shard, part in zip(self.shards, parts, strict=True):
            shard.apply(table, part)

    def push_own_rows(self, table: str, parts: Sequence[SparseRows]) -> None:
        """Apply the parts :meth:`EmbeddingTable.push_gradient` made of the table's own
        gradient in this process, without the checks of a gradient's contents
        (:meth:`tensorfleet.ps.row_store.RowStore.apply` with ``trusted=True``): its ids
        were checked at the lookup, are unique and ascending (``torch.unique``, coalesced)
        and on the shard the partition gives, its values are autograd's gradient of rows of
        the table's dtype and dim. Non-finite values are applied as torch's optimizers apply
        them to an ``nn.Embedding``'s weight (``tfl.NanGuard`` vetoes such steps)."""
        for shard, part in zip(self.shards, parts, strict=True):
            shard.apply(table, part, trusted=True)

    def save(self, tables_since: Sequence[dict] | None = None) -> list[dict[str, bytes]]:
        """Each shard's tables as row store documents (:meth:`ShardTables.save`), by shard;
        ``tables_since``: per shard, the tags to save deltas since (None: in full)."""
        return [
            shard.save(None if tables_since is None else tables_since[k])
            for k, shard in enumerate(self.shards)
        ]

    def restore(self, documents: Sequence[dict[str, bytes]]) -> None:
        """Replace each shard's tables with ``documents[shard]`` (CheckpointError naming the
        table when a document does not fit the table this source holds)."""
        for shard, tables in zip(self.shards, documents, strict=True):
            shard.restore(tables)
