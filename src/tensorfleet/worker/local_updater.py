"""The one-process stand-in for the parameter servers, so that the same training script runs
without a cluster: the update rule is applied to the model in place, and the global step is
a local counter. It implements the :class:`~tensorfleet.worker.updater.Updater` protocol; a
one-process run's checkpoint is one shard document, the same format a ps shard writes, so
``load_checkpoint`` reads both alike.

The model's :class:`~tensorfleet.EmbeddingTable` modules are trained as the ps modes train
them (:class:`~tensorfleet.worker.table_attachment.TableAttachment`): attached when the model
is wrapped to a :class:`~tensorfleet.worker.local_row_source.LocalRowSource` of one shard,
named after their place in the model, created with the same row-sparse rule (the table's
own, else ``sparse_rule``, else the optimizer's twin), and each step's row gradient pushed
with the dense update. Their rows go in the checkpoint document (``table/<name>``, the row
store's document, as in a ps shard's) and come back on restore."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tensorfleet.errors import CheckpointError, CheckpointMismatch, ConfigError, UsageError
from tensorfleet.ps.bare_step import bare_step
from tensorfleet.ps.buffer_policies import persistent_buffers
from tensorfleet.ps.shard_checkpoint import ShardState
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.task_memory import peak_rss_bytes
from tensorfleet.worker.local_row_source import LocalRowSource
from tensorfleet.worker.moving_average import MovingAverage
from tensorfleet.worker.progress import Agreement, Progress
from tensorfleet.worker.replica_state import (
    check_buffers,
    decode_replica,
    encode_replica,
    load_buffers,
    load_replica,
)
from tensorfleet.worker.table_attachment import TableAttachment, find_tables
from tensorfleet.worker.updater import (
    CheckpointSource,
    DataPosition,
    NamedParams,
    Restored,
    SavedState,
    retune_optimizer,
    whole_placement,
)

log = logging.getLogger("tensorfleet.local")


class LocalUpdater:
    """Applies the update rule locally; the model's parameters are the variables, and its
    embedding tables' rows live in this process (module docstring). ``sparse_rule``: the
    row-sparse rule of the tables without one of their own (None: the optimizer's twin)."""

    discipline: UpdateDiscipline | None = None
    collective = False

    def __init__(
        self, ema_decay: float | None = None, sparse_rule: SparseRowRule | None = None
    ) -> None:
        self._optimizer: torch.optim.Optimizer | None = None
        self._global_step = 0
        self._ema_decay = ema_decay
        self._moving_average: MovingAverage | None = None
        self._named_params: list[tuple[str, torch.Tensor]] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._rule: UpdateRule | None = None
        self._data: dict[str, Any] | None = None
        self._sparse_rule = sparse_rule
        self.tables: TableAttachment | None = None
        """The model's embedding tables in this process (None: the model has none)."""
        self.row_source: LocalRowSource | None = None

    def connect(self, device: torch.device | None = None) -> None:
        """Nothing to connect to."""

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as it is; its embedding tables are attached to this process's rows."""
        self._buffers = persistent_buffers(model)
        tables = find_tables(model)
        if self._sparse_rule is not None and not tables:
            raise ConfigError(
                f"sparse_optimizer={self._sparse_rule.name!r}: in one process it is the rule "
                f"of the model's EmbeddingTables, and this model has none (the weights of "
                f"sparse=True nn.Embedding modules are updated by the optimizer, torch's, "
                f"here); fix: leave sparse_optimizer out"
            )
        if not tables:
            return model
        for place, table in tables:
            if table.attached:  # as a cluster does: the session's rows and rule, said aloud
                log.warning(
                    "EmbeddingTable %r was attached to a row source before the session "
                    "started; the session attaches it to rows of its own (fresh, created on "
                    "first use, and saved in its checkpoints) with its own rule= if it has one, "
                    "else the session's, as a cluster does; its rows so far are not used",
                    table.table_name or place,
                )
        if self._ema_decay is not None:
            log.warning(
                "ema_decay: the moving average covers the dense parameters only, not the rows "
                "of the embedding tables %s (as on the ps)",
                [table.table_name or place for place, table in tables],
            )
        self.row_source = LocalRowSource([], num_shards=1)
        self.tables = TableAttachment(tables, self.row_source, num_shards=1)
        return model

    def placement(self) -> dict[str, Any]:
        """What the placement report shows beyond the variables: where the tables' rows are."""
        if self.tables is None:
            return {}
        return {"stored_on": {t.spec().name: "local (rows)" for t in self.tables.tables}}

    def register(self, named_params: NamedParams, rule: UpdateRule) -> None:
        """Build the optimizer of ``named_params`` and create the tables with their
        row-sparse rules (a table whose rule cannot be decided is refused here, at start)."""
        self._named_params, self._rule = list(named_params), rule
        self._optimizer = rule.build([p for _, p in named_params])
        if self.tables is not None:
            self.tables.create(rule, self._sparse_rule)
        if self._ema_decay is not None:
            self._moving_average = MovingAverage(named_params, self._ema_decay)

    def restore(self, checkpoints: CheckpointSource | None, resume: bool = True) -> Restored:
        """Resume from the newest valid checkpoint, if there is one (and ``resume``)."""
        checkpoint = checkpoints.newest() if checkpoints is not None and resume else None
        if checkpoint is None:
            return Restored(self._global_step)
        try:  # nothing changes until the whole checkpoint is known to fit
            state = self._decode(checkpoint.documents)
            check_buffers(state.buffers, self._buffers)
            before = self._restore_tables(state.tables)
            try:
                optimizer = load_replica(state, self._named_params, self._rule)
            except ValueError:
                if self.row_source is not None:
                    self.row_source.restore(before)
                raise
            load_buffers(state.buffers, self._buffers)
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} cannot be restored: {exc}. Start fresh "
                "(restore=False) or point checkpoint_dir elsewhere"
            ) from None
        checkpoints.restoring(checkpoint)
        self._optimizer = optimizer
        if self._moving_average is not None:
            self._moving_average.load(state.ema if state.ema is not None else state.values)
        self._global_step = checkpoint.global_step
        return Restored(self._global_step, state.worker_data.get("local"))

    def _restore_tables(self, saved: dict[str, bytes]) -> list[dict[str, bytes]]:
        """Put the checkpoint's table rows in place; returns the rows before, to undo it.
        The checkpoint must hold exactly the model's tables (CheckpointMismatch)."""
        mine = {t.spec().name for t in self.tables.tables} if self.tables is not None else set()
        if set(saved) != mine:
            raise CheckpointMismatch(
                f"the checkpoint holds the embedding tables {sorted(saved)}, the model has "
                f"{sorted(mine)}; fix: build the model as it was trained"
            )
        if self.row_source is None:
            return []
        before = self.row_source.save()
        self.row_source.restore([saved])
        return before

    def _decode(self, documents: Sequence[bytes]) -> ShardState:
        if self._optimizer is None or self._rule is None:
            raise UsageError("register() the model before restoring")
        if len(documents) != 1:
            raise ConfigError(
                f"a one-process run restores a checkpoint of one shard, this one has {len(documents)}"
            )
        return decode_replica(documents[0], self._named_params)

    def pull(self) -> Progress:
        return Progress(self._global_step, stop=False)

    def push_pull(
        self,
        count_step: bool = True,
        step: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> Progress:
        """Apply the gradients; ``count_step`` False applies them without counting a step."""
        if self._optimizer is None:
            raise UsageError("register() the model before training")
        bare_step(self._optimizer)
        if self._moving_average is not None:
            self._moving_average.update()
        if self.tables is not None:
            self.tables.push()
        if count_step:
            self._global_step += 1
        self._data = data
        return Progress(self._global_step, stop=False)

    def exchange(self, step: int, data: DataPosition | None) -> Progress:
        return self.push_pull(step=step, data=data)

    def retune(self, hyperparameters: dict[str, Any]) -> None:
        """The optimizer's parameter group takes them (checked by the rule first)."""
        retune_optimizer(self._optimizer, self._rule, hyperparameters)

    def skip(self, step: int) -> Progress:
        """Nothing to exchange: the update is simply not applied (nor the tables' rows)."""
        if self.tables is not None:
            self.tables.discard()
        return Progress(self._global_step, stop=False, made_step=False, dropped=True)

    def agree(self, stop: bool, checkpoint: bool = False, preempted: bool = False) -> Agreement:
        return Agreement(stop, checkpoint, preempted)

    def save(
        self, data: DataPosition | None = None, tables_since: Sequence[dict] | None = None
    ) -> SavedState:
        """The model, optimizer state, moving average, global step and data position (as of
        the last exchange) as one document (the format of a ps shard's checkpoint)."""
        if self._optimizer is None or self._rule is None:
            raise UsageError("register() the model before saving")
        worker_data = {} if self._data is None else {"local": self._data}
        placement = whole_placement(self._named_params)
        tables = None
        if self.tables is not None and self.row_source is not None:
            placement.update(self.tables.placement())
            tables = self.row_source.save(tables_since)[0]  # table/<name>: each table's rows
        document = encode_replica(
            self._named_params,
            self._optimizer,
            self._rule,
            self._moving_average,
            self._global_step,
            worker_data,
            self._buffers,
            tables,
        )
        return SavedState(self._global_step, [document], placement)

    def finish(self, before_done: Callable[[], object] | None, failed: bool = False) -> None:
        """Nobody to tell: the final checkpoint, unless the loop failed."""
        if before_done is not None and not failed:
            before_done()

    def leave(self) -> None:
        """Nobody waits for this process."""

    def close(self) -> None:
        """Nothing to close."""

    def stats(self) -> list[dict[str, Any]]:
        """With embedding tables, one record for the rows this process holds (as a ps
        shard's: ``tables`` by name, ``peak_rss_bytes``, ``mode`` ``local``), so that code
        reading a cluster's table numbers reads these the same way; else none."""
        if self.tables is None:
            return []
        return [
            {"mode": "local", "tables": shard.stats(), "peak_rss_bytes": peak_rss_bytes()}
            for shard in self.row_source.shards
        ]

    def moving_average(self) -> dict[str, torch.Tensor]:
        if self._moving_average is None:
            raise ConfigError("no moving average is kept: pass ema_decay to the TrainingSession")
        return self._moving_average.state()
