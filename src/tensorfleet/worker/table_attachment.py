"""The embedding tables of a model trained in a session: found in the model, attached to
where their rows live, created there, and their row gradients pushed each step.

``PsUpdater`` holds one :class:`TableAttachment` over the ps shards (a
:class:`~tensorfleet.worker.ps_row_source.PsRowSource`) when the model has
:class:`~tensorfleet.worker.embedding_table.EmbeddingTable` modules; ``LocalUpdater`` (one
process) holds one over a :class:`~tensorfleet.worker.local_row_source.LocalRowSource` of one
shard, so that the same script trains its tables alone and on a cluster. A table without a name
takes its place in the model (``towers.user``). Its row-sparse rule is the table's own
``rule`` attribute when it has one, else the session's ``sparse_optimizer`` (e.g.
``tfl.optim.SparseAdam(...)``) when it has one, else the session's update rule by name
(``sgd``, ``adagrad``). Each step the table's touched rows are pushed before the dense gradients: applied
at once by their shards in async training, held for the step's mean in sync training (the
push names its step) and until the staleness gate releases the dense push with
``max_staleness`` (:mod:`tensorfleet.ps.held_row_gradients`).
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.sparse_update_rules import SparseRowRule, SparseRuleError
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.worker.embedding_table import EmbeddingTable, RowSource


class TableSource(RowSource, Protocol):
    """A row source that creates tables and is told the sync step of a push: ``PsRowSource``
    (the shards) or ``LocalRowSource`` (this process; it ignores the step)."""

    sync_step: int | None

    def create(self, table: TableSpec, partition: RowPartition, rule: SparseRowRule) -> object: ...


def find_tables(model: nn.Module) -> list[tuple[str, EmbeddingTable]]:
    """The model's embedding tables with their places in it."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, EmbeddingTable)]


def table_rule(
    table: EmbeddingTable, rule: UpdateRule, sparse_rule: SparseRowRule | None
) -> SparseRowRule:
    """The row-sparse rule of ``table``: its own ``rule``, else ``sparse_rule``, else
    ``rule``'s row-sparse twin (SparseRuleError naming the table and the fixes when ``rule``
    has none, e.g. ``adam``)."""
    if table.rule is not None:
        return table.rule
    if sparse_rule is not None:
        return sparse_rule
    try:
        return SparseRowRule.from_dense(rule.name, rule.hyperparameters)
    except SparseRuleError as exc:
        raise SparseRuleError(
            f"EmbeddingTable {table.spec().name!r} updates its rows with a row-sparse rule, "
            f"by default the optimizer's twin, and optimizer {rule.name!r} has none: {exc}; "
            f"fix: give the table a rule of its own (tfl.EmbeddingTable(..., "
            f"rule=tfl.optim.SparseAdam(lr=...))), or pass TrainingSession(..., "
            f"sparse_optimizer=tfl.optim.SparseAdam(lr=...)), or train with tfl.optim.SGD or "
            f"tfl.optim.Adagrad"
        ) from None


class TableAttachment:
    """``tables`` (place, table) on ``num_shards`` shards through ``source``."""

    def __init__(
        self, tables: list[tuple[str, EmbeddingTable]], source: TableSource, num_shards: int
    ) -> None:
        self.source = source
        self.tables = [table for _, table in tables]
        for place, table in tables:
            table.attach(source, num_shards, name=table.table_name or place)

    def create(self, rule: UpdateRule, sparse_rule: SparseRowRule | None = None) -> None:
        """Every shard holds its part of every table (idempotent: every worker asks), with
        the table's own rule, else ``sparse_rule``, else ``rule``'s row-sparse twin."""
        for table in self.tables:
            row_rule = table_rule(table, rule, sparse_rule)
            self.source.create(table.spec(), table.partition, row_rule)
            table.bound_rule = row_rule

    def placement(self) -> dict[str, dict[str, object]]:
        """The partition plan of every table, for the checkpoint's manifest (``table/<name>``:
        rows, dim, scheme and shards; each shard's document holds its rows)."""
        return {
            f"table/{table.spec().name}": {
                "table": table.spec().name,
                "num_rows": table.num_rows,
                "dim": table.dim,
                "partition": table.partition.scheme,
                "shards": table.partition.num_shards,
            }
            for table in self.tables
        }

    def push(self, sync_step: int | None = None) -> None:
        """Push every table's row gradient of this step (``sync_step``: the sync step it
        belongs to; None in async training)."""
        self.source.sync_step = sync_step
        for table in self.tables:
            table.push_gradient()

    def send_lookups_ahead(self) -> None:
        """Send the lookups the tables were told of with ``prefetch`` (a step's exchange,
        where :mod:`tensorfleet.worker.lookup_ahead` says)."""
        for table in self.tables:
            table.send_ahead()

    def release(self, where: str) -> None:
        """The session ended: lookups of the tables raise ``UsageError`` from now on (their
        rows were on ``where``, which ends with the training)."""
        for table in self.tables:
            table.release(where)

    def discard(self) -> None:
        """Forget this step's row gradients (a vetoed update)."""
        for table in self.tables:
            table.take_gradient()
