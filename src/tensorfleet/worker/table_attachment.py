"""The embedding tables of a model trained through the ps shards: found in the model,
attached to the shards, created there, and their row gradients pushed each step.

``PsUpdater`` holds one :class:`TableAttachment` when the model has
:class:`~tensorfleet.worker.embedding_table.EmbeddingTable` modules. A table without a name
takes its place in the model (``towers.user``). Its row-sparse rule is the table's own
``rule`` attribute when it has one, else the session's ``sparse_optimizer`` (e.g.
``tfl.optim.SparseAdam(...)``) when it has one, else the session's update rule by name
(``sgd``, ``adagrad``). Each step the table's touched rows are pushed before the dense gradients: applied
at once by their shards in async training, held for the step's mean in sync training (the
push names its step) and until the staleness gate releases the dense push with
``max_staleness`` (:mod:`tensorfleet.ps.held_row_gradients`).
"""

from __future__ import annotations

from torch import nn

from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.worker.embedding_table import EmbeddingTable
from tensorfleet.worker.ps_row_source import PsRowSource


def find_tables(model: nn.Module) -> list[tuple[str, EmbeddingTable]]:
    """The model's embedding tables with their places in it."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, EmbeddingTable)]


class TableAttachment:
    """``tables`` (place, table) on ``num_shards`` shards through ``source``."""

    def __init__(
        self, tables: list[tuple[str, EmbeddingTable]], source: PsRowSource, num_shards: int
    ) -> None:
        self.source = source
        self.tables = [table for _, table in tables]
        for place, table in tables:
            table.attach(source, num_shards, name=table.table_name or place)

    def create(self, rule: UpdateRule, sparse_rule: SparseRowRule | None = None) -> None:
        """Every shard holds its part of every table (idempotent: every worker asks), with
        the table's own rule, else ``sparse_rule``, else ``rule``'s row-sparse twin."""
        for table in self.tables:
            row_rule = (
                getattr(table, "rule", None)
                or sparse_rule
                or SparseRowRule.from_dense(rule.name, rule.hyperparameters)
            )
            self.source.create(table.spec(), table.partition, row_rule)

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

    def discard(self) -> None:
        """Forget this step's row gradients (a vetoed update)."""
        for table in self.tables:
            table.take_gradient()
