"""Embedding-table row gradients held back until the step they belong to is decided.

In asynchronous training a shard applies a table's rows as they arrive (``push_rows``). Two
disciplines hold them instead, so that tables follow the same rule as the dense variables:

* ``sync``: the rows a worker pushes for step ``t`` (``push_rows`` carries ``step``) wait
  until the shard makes step ``t`` (:meth:`HeldRowGradients.step_made`, called by the sync
  step with the workers whose dense gradients made it). Each table then takes one update
  with the mean over those workers of their rows, over the union of the rows: a row a
  worker did not touch counts as zero, as in the dense mean. The sum runs in worker order
  and is divided by the number of contributions, the dense sync step's arithmetic, so a
  table equals the same table held dense and averaged. The rows of a worker whose gradients
  did not make the step (stale, or beyond the quota of backup workers) are dropped with
  them, and every table counts one step per step made, also when no contribution touched
  its rows on this shard (Adagrad's ``lr_decay`` and Adam's bias correction count steps).
* ``max_staleness``: a worker pushes its rows just before its dense gradients; the rows
  wait, in arrival order, until the staleness gate releases that worker's dense push
  (:meth:`HeldRowGradients.released`), and are then applied as in asynchronous training.

Every gradient is checked against its table before it is held (a refusal then, not at the
step), and copied (the received bytes are not kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tensorfleet.errors import ProtocolError
from tensorfleet.ps.shard_tables import ShardTables
from tensorfleet.ps.sparse_rows import SparseRows


class HeldRowGradients:
    """The row gradients of ``tables()`` a shard holds back: per step (``sync``) or per
    worker until the staleness gate releases it (``gated``)."""

    def __init__(self, tables: Callable[[], ShardTables], *, sync: bool, gated: bool) -> None:
        self._tables = tables
        self.sync, self.gated = sync, gated
        self._by_step: dict[int, dict[str, dict[str, SparseRows]]] = {}
        self._by_worker: dict[str, list[tuple[str, SparseRows]]] = {}

    def hold(self, task: str, table: str, gradient: SparseRows, step: object) -> None:
        """Keep a copy of worker ``task``'s ``gradient`` of ``table`` (already checked):
        until step ``step`` is made (sync), or until ``task``'s push is released."""
        kept = SparseRows(gradient.indices.clone(), gradient.values.clone())
        if self.sync:
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ProtocolError(
                    f"in sync training push_rows needs the integer 'step' its rows belong to, "
                    f"got {step!r}"
                )
            # A second push of the same worker, step and table (after a restart) replaces it.
            self._by_step.setdefault(step, {}).setdefault(task, {})[table] = kept
        else:
            self._by_worker.setdefault(task, []).append((table, kept))

    def step_made(self, step: int, tasks: Sequence[str]) -> None:
        """Sync step ``step`` was made with the gradients of ``tasks`` (in worker order):
        update every table once with their mean rows; drop what older steps still hold."""
        held = self._by_step.pop(step, {})
        for old in [s for s in self._by_step if s < step]:
            del self._by_step[old]  # stale: their dense gradients were dropped too
        tables = self._tables()
        for store in tables:
            name = store.table.name
            parts = [held[t][name] for t in tasks if name in held.get(t, {})]
            store.apply(mean_rows(parts, len(tasks), store.table.dim, store.table.torch_dtype))

    def released(self, task: str) -> None:
        """The staleness gate applied ``task``'s push: apply the rows it pushed before it."""
        for table, gradient in self._by_worker.pop(task, []):
            self._tables().apply(table, gradient)

    @property
    def held_rows(self) -> int:
        """Rows held now (all steps, workers and tables)."""
        by_step = sum(
            g.num_rows for w in self._by_step.values() for t in w.values() for g in t.values()
        )
        return by_step + sum(g.num_rows for q in self._by_worker.values() for _, g in q)


def mean_rows(parts: Sequence[SparseRows], count: int, dim: int, dtype: torch.dtype) -> SparseRows:
    """The mean of ``count`` contributions of which ``parts`` touched some rows (the others
    count as zero): the union of their rows, summed in order, divided by ``count``."""
    if not parts:
        return SparseRows(torch.empty(0, dtype=torch.int64), torch.empty((0, dim), dtype=dtype))
    union, position = torch.unique(
        torch.cat([p.indices for p in parts]), sorted=True, return_inverse=True
    )
    total = torch.zeros((union.numel(), dim), dtype=dtype)
    start = 0
    for part in parts:  # each part's rows are unique: every row gets one addition per part
        total.index_add_(0, position[start : start + part.num_rows], part.values)
        start += part.num_rows
    total.div_(count)
    return SparseRows(union, total)
