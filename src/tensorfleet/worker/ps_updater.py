"""``PsUpdater``: the parameter-server modes (``async``, ``sync``) as an
:class:`~tensorfleet.worker.updater.Updater`.

It owns what is particular to training through parameter servers, on top of the wire-level
:class:`~tensorfleet.worker.client.ParameterClient`: the placement plan (which shard holds
which variable), the update discipline the shards apply, who restores the shards (the chief:
at start when they are empty, and whenever one restarts empty during training), and what a
vetoed update means per discipline (async: push nothing; sync: push zeros, because every
step waits for its quota of workers), and the model's persistent buffers, which live on the
shards too (:mod:`tensorfleet.worker.buffer_exchange`). The model's ``tfl.EmbeddingTable``
modules and its ``sparse=True`` embedding weights (held as rows, mirrored whole here:
:mod:`tensorfleet.worker.mirrored_embeddings`) are attached to the shards in :meth:`wrap`.

With an :class:`~tensorfleet.worker.push_overlap.Overlap` (async mode without
``max_staleness``) the gradients go through a
:class:`~tensorfleet.worker.bucketed_push.BucketedPush` once the session drives it
(:meth:`PsUpdater.step_overlap`); every other operation first settles it, so that it sees
the exchange complete.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tensorfleet import environment, task_markers
from tensorfleet.errors import ConfigError, UsageError
from tensorfleet.ps.buffer_policies import persistent_buffers
from tensorfleet.ps.model_namespace import ModelClaim
from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.wire.message import Limits
from tensorfleet.worker.bucketed_push import BucketedPush, StepOverlap
from tensorfleet.worker.buffer_exchange import BufferExchange, place_buffers, placement_report
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.mirrored_embeddings import (
    MirroredEmbeddings,
    find_sparse_embeddings,
    mirror_weight,
)
from tensorfleet.worker.progress import Agreement, Progress
from tensorfleet.worker.ps_row_source import PsRowSource
from tensorfleet.worker.push_overlap import Overlap, automatic_overlap, kept_prefetch
from tensorfleet.worker.sparse_gradient import densify_sparse_gradients
from tensorfleet.worker.sync_batch_norm import warn_unsynchronized
from tensorfleet.worker.table_attachment import TableAttachment, find_tables
from tensorfleet.worker.timeline import Timeline
from tensorfleet.worker.timeouts import ClientTimeouts
from tensorfleet.worker.updater import (
    CheckpointSource,
    DataPosition,
    NamedParams,
    Restored,
    SavedState,
    zero_gradients,
)

log = logging.getLogger("tensorfleet.session")


class PsUpdater:
    """One worker training through the ps shards at ``ps_addresses`` with ``plan`` and
    ``discipline``; ``is_chief``: this worker creates (or restores) the variables, saves the
    checkpoints and declares the end of training.

    ``sparse_rule``: the row-sparse rule of the ``sparse=True`` embedding weights and of the
    embedding tables without a rule of their own (None: the update rule's row-sparse twin).
    ``replan(leave_out)``: the placement plan without the variables named (the sparse
    embedding weights, held as rows); None: ``plan`` with them taken out.
    ``variables``: the session's trainable parameters, which name the weights found in the
    model (an engine may wrap it); None: the model's own names."""

    collective = False

    def __init__(
        self,
        ps_addresses: Sequence[str],
        secret: bytes,
        task_name: str,
        *,
        is_chief: bool,
        plan: PlacementPlan,
        discipline: UpdateDiscipline,
        timeouts: ClientTimeouts | None = None,
        encrypt: bool = False,
        limits: Limits | None = None,
        log_placement: bool = False,
        model: ModelClaim | None = None,
        sparse_rule: SparseRowRule | None = None,
        replan: Callable[[set[str]], PlacementPlan] | None = None,
        variables: Sequence[tuple[str, torch.Tensor]] | None = None,
        gradient_dtype: str | None = None,
        values_dtype: str | None = None,
        overlap: Overlap | None = None,
    ) -> None:
        self.client = ParameterClient(
            ps_addresses,
            secret,
            task_name,
            timeouts,
            limits=limits,
            encrypt=encrypt,
            model=model,
            gradient_dtype=gradient_dtype,
            values_dtype=values_dtype,
        )
        self.is_chief = is_chief
        self._serving = False
        self._saved_step: int | None = None  # the global step of the newest save()
        self.plan = plan
        self.discipline: UpdateDiscipline | None = discipline
        self._initialized: list[bool] = []
        self._named_params: list[tuple[str, torch.Tensor]] = []
        self._rule: UpdateRule | None = None
        self._log_placement = log_placement
        self.buffers: BufferExchange | None = None
        """The model's persistent buffers on the shards (None: the model has none)."""
        self.tables: TableAttachment | None = None
        self._row_source: PsRowSource | None = None
        """Where the rows of the tables and sparse=True weights go (None: the model has
        neither); a step's row pushes are awaited after its dense exchange
        (:mod:`tensorfleet.worker.rows_in_flight`)."""
        """The model's embedding tables on the shards (None: the model has none)."""
        self.mirrored: MirroredEmbeddings | None = None
        """The model's sparse=True embedding weights, rows on the shards (None: none)."""
        self.sparse_rule = sparse_rule
        self._replan = replan
        self._variable_names = None if variables is None else {id(p): n for n, p in variables}
        self._limits = limits or Limits()
        self._overlap = overlap if overlap is not None and overlap.active else None
        self._during_backward: bool | None = None
        """Set when the session drives the overlap: whether buckets may go in the backward."""
        self.overlapped: BucketedPush | None = None
        """The overlapped pushes, once registered (None: one push per shard, awaited)."""

    def connect(self, device: torch.device | None = None) -> None:
        """Say hello to every shard (the device does not matter: values travel via the CPU)."""
        self._initialized = self.client.connect()

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as it is. Its embedding tables and ``sparse=True`` embedding weights
        are attached to the shards (the weights leave the dense plan), then its persistent
        buffers are placed next to their modules' parameters in the plan that remains."""
        warn_unsynchronized(model, self.discipline.mode if self.discipline else "async")
        tables = find_tables(model)
        sparse = find_sparse_embeddings(model, self._variable_names)
        if tables or sparse:
            source = self._row_source = PsRowSource(
                lambda: self.client._shards,
                self.client._recovering,
                self.client.task_name,
                self.client.timeouts.step_s,
                recover=self.client.recover,
            )
        if tables:
            self.tables = TableAttachment(tables, source, self.client.num_shards)
        if sparse:
            self._mirror(sparse, source)
        buffers = persistent_buffers(model)
        if buffers:
            placement = place_buffers(self.plan, buffers)
            if self._log_placement:
                print(placement_report(placement, buffers), flush=True)
            self.buffers = BufferExchange(
                lambda: self.client._shards,
                self.client._recovering,
                buffers,
                placement,
                self.client.task_name,
                self.client.timeouts.step_s,
            )
        return model

    def _mirror(self, sparse: list[tuple[str, nn.Module]], source: PsRowSource) -> None:
        """Hold the ``sparse=True`` embedding weights as rows: out of the dense plan."""
        weights = [mirror_weight(name, m, self.client.num_shards) for name, m in sparse]
        names = {w.name for w in weights}
        clash = names & {t.spec().name for t in self.tables.tables} if self.tables else set()
        if clash:
            raise ConfigError(
                f"the ps would hold an EmbeddingTable and a sparse=True embedding weight under "
                f"the same name {sorted(clash)}; fix: give the EmbeddingTable another name"
            )
        if self.discipline is not None and self.discipline.ema_decay is not None:
            raise ConfigError(
                f"ema_decay: the ps keeps no moving average of the sparse=True embedding "
                f"weights {sorted(names)}, which it holds as rows; fix: train without "
                f"ema_decay, or build those embeddings with sparse=False (dense variables, "
                f"averaged like the others)"
            )
        self.plan = self._replan(names) if self._replan is not None else _without(self.plan, names)
        # Half the message limit: the header and the other buffers fit beside the rows.
        self.mirrored = MirroredEmbeddings(weights, source, self._limits.max_message_bytes // 2)

    def placement(self) -> dict[str, Any]:
        """What the placement report shows beyond the plan: where the rows of the sparse
        embedding weights are."""
        return {} if self.mirrored is None else {"stored_on": self.mirrored.stored_on()}

    def register(self, named_params: NamedParams, rule: UpdateRule) -> None:
        """The dense variables are ``named_params`` but the sparse embedding weights (held as
        rows, whose row-sparse rules are decided here: a refusal before any shard changes)."""
        named_params = list(named_params)
        if self.mirrored is not None:
            missing = self.mirrored.names - {name for name, _ in named_params}
            if missing:
                raise ConfigError(
                    f"the sparse=True embedding weights {sorted(missing)} are not among the "
                    f"registered parameters; register the parameters of the model given to wrap()"
                )
            self.mirrored.bind_rules(rule, self.sparse_rule)
            if self._log_placement:  # with the rules: their slots count in the bytes
                print(self.mirrored.report(), flush=True)
            named_params = [(n, p) for n, p in named_params if n not in self.mirrored.names]
        self._named_params, self._rule = named_params, rule

    def _prefetch_blockers(self) -> list[str]:
        """What this model exchanges after each step's outcome (so prefetch cannot apply).

        Not the embedding tables: where prefetch applies (async without ``max_staleness``)
        a shard applies a step's rows as they arrive, and a lookup sent after them on the
        same channel reads them updated, whether or not the step waited for the replies;
        with prefetch a step's row pushes are awaited at the next step's exchange, as its
        dense replies are (:meth:`exchange`)."""
        blockers = []
        if self.buffers is not None:
            blockers.append(f"persistent buffers {sorted(self.buffers.buffers)}")
        if self.mirrored is not None:
            blockers.append(f"sparse=True embedding weights {sorted(self.mirrored.names)}")
        return blockers

    def restore(self, checkpoints: CheckpointSource | None, resume: bool = True) -> Restored:
        """The chief creates the variables, or, when the shards started empty and ``resume``,
        brings them to the newest checkpoint; the others wait for that. With
        ``checkpoints``, the chief also restores from them any shard that restarts empty
        later. Every worker gets back its data position as the ps recorded it."""
        if self._rule is None:
            raise UsageError("register() the model before restore()")
        resume_from = None
        # The shards wait for the chief's checkpoint when they are preempted (only if it
        # keeps checkpoints: ps/preemption_drain.py).
        self.client.saves_checkpoints = self.is_chief and checkpoints is not None
        if self.is_chief and checkpoints is not None:
            if resume and not all(self._initialized):
                resume_from = checkpoints.newest()  # the ps tasks started empty: resume
                if resume_from is not None:
                    checkpoints.restoring(resume_from)
            self.client.restore_shards = lambda: self._checkpoint_for_restarted(checkpoints)
        if self.mirrored is not None and self.is_chief:
            # A shard restarted without a checkpoint takes the tables again from this copy.
            self.client.recreate_tables = self.mirrored.recreate
            if resume_from is None:  # filled before the dense variables: see the module
                self.mirrored.create(is_chief=True)
        global_step = self.client.register(
            self._named_params,
            self.plan,
            self._rule,
            self.is_chief,
            self.discipline,
            resume=None
            if resume_from is None
            else (resume_from.global_step, resume_from.documents),
        )
        if self.mirrored is not None and (not self.is_chief or resume_from is not None):
            self.mirrored.create(is_chief=self.is_chief)  # the same tables, complete
        if self.tables is not None:
            self.tables.create(self._rule, self.sparse_rule)
        if self.buffers is not None:
            sync = self.discipline is not None and self.discipline.mode == "sync"
            buffers, mode = self.buffers, "sync" if sync else "async"
            buffers.create(mode, self.is_chief)
            if self.is_chief:  # a restarted shard serves them again once they are created
                self.client.recreate_buffers = lambda: buffers.create(mode, is_chief=True)
        self._overlap = self._automatic_overlap()
        if self._overlap is not None and self._during_backward is not None:
            self.overlapped = BucketedPush(
                self.client,
                self._named_params,
                self._overlap,
                hooks=self._during_backward and self._overlap.bucket_bytes is not None,
                # their exchanges follow each step's outcome: see push_overlap.py
                prefetch=kept_prefetch(
                    self._overlap, self.client.task_name, self._prefetch_blockers()
                ),
            )
        return Restored(global_step, self.client.restored_data)

    def _automatic_overlap(self) -> Overlap | None:
        """The overlap after :func:`~tensorfleet.worker.push_overlap.automatic_overlap`'s
        rule (the session's default gives way when buckets could only slow the step)."""
        overlap = automatic_overlap(
            self._overlap,
            ps_on_this_host=self.client.every_shard_on_this_host,
            on_cpu=all(p.device.type == "cpu" for _, p in self._named_params),
            threads=torch.get_num_threads(),
            host_cores=environment.host_cpu_count(),
            task=self.client.task_name,
        )
        return overlap if overlap is not None and overlap.active else None

    @property
    def overlap(self) -> Overlap | None:
        """The overlap this updater applies (None: none, e.g. sync mode or max_staleness,
        where each step is one whole push)."""
        return self._overlap

    def step_overlap(self, during_backward: bool) -> StepOverlap:
        """The session drives the overlap of its steps (``during_backward``: nothing after
        the backward pass changes or vetoes the gradients, so buckets may go during it)."""
        if self._overlap is not None:
            self._during_backward = during_backward
        return StepOverlap(lambda: self.overlapped)

    def _settle(self, failed: bool = False) -> None:
        """Complete the overlapped exchange before any other operation: its dense replies
        and, with prefetch, the last step's row pushes."""
        if self.overlapped is not None:
            self.overlapped.settle(discard=failed)
        if self._row_source is not None:
            self._row_source.settle_pushes(failed=failed)

    @staticmethod
    def _checkpoint_for_restarted(
        checkpoints: CheckpointSource,
    ) -> tuple[int, Sequence[bytes]] | None:
        checkpoint = checkpoints.newest()
        if checkpoint is None:
            return None
        checkpoints.restoring(checkpoint)
        return checkpoint.global_step, checkpoint.documents

    def pull(self) -> Progress:
        self._settle()
        progress = self.client.pull()
        if self.mirrored is not None:
            self.mirrored.pull()
        if self.buffers is not None:
            self.buffers.pull()
        return progress

    def trace(self, timeline: Timeline) -> None:
        """Record the exchanges with the shards (pack, push/pull, wait, unpack) in ``timeline``."""
        self.client.trace(timeline)

    def exchange(self, step: int, data: DataPosition | None) -> Progress:
        """Push the rows of the sparse embedding weights and of the tables, then the dense
        gradients (a sparse gradient of another parameter as the dense gradient of its
        variable: see :func:`densify_sparse_gradients`), bring the changed rows into the
        sparse embedding weights, and exchange the buffers."""
        sync_step = step if self.discipline is not None and self.discipline.mode == "sync" else None
        rows = self._row_source
        prefetching = self.overlapped is not None and self.overlapped.prefetch
        if rows is not None:  # the rows' replies are awaited after the dense exchange's
            if prefetching:  # the step before's, left in flight with its dense replies
                rows.settle_pushes()
            rows.defer_pushes()
        try:
            if self.mirrored is not None:
                self.mirrored.push(sync_step=sync_step)
            if self.tables is not None:
                self.tables.push(sync_step=sync_step)
                if self._rows_applied_at_once():  # behind the rows, beside the dense trip
                    self.tables.send_lookups_ahead()
            if self.overlapped is not None:  # the sparse gradients are densified by bucket
                progress = self.overlapped.exchange(step, data)
            else:
                densify_sparse_gradients(self._named_params)
                progress = self.client.push_pull(step=step, data=data)
        except BaseException:
            if rows is not None:
                rows.settle_pushes(failed=True)
            raise
        if rows is not None and not prefetching:  # with prefetch: at the next exchange
            rows.settle_pushes()
        if self.mirrored is not None:
            self.mirrored.pull()  # after the dense reply: this step's rows are applied
        if not self._serving and not progress.dropped:
            # past its first step: a launcher that sees it killed now sees no crash loop
            self._serving = True
            task_markers.mark_serving(self.client.task_name)
        progress = self._exchange_buffers(step, progress)
        self._send_held_lookups_ahead()
        return progress

    def _rows_applied_at_once(self) -> bool:
        """Whether a shard applies a row push when it arrives (async without
        ``max_staleness``), so that a lookup sent right behind it reads the updated rows; else
        the rows are held, and the lookups sent ahead go at the end of the exchange
        (:mod:`tensorfleet.worker.lookup_ahead`)."""
        discipline = self.discipline
        return discipline is None or (
            discipline.mode == "async" and discipline.max_staleness is None
        )

    def _send_held_lookups_ahead(self) -> None:
        """At the end of an exchange whose rows the shards held: send the lookups prefetched."""
        if self.tables is not None and not self._rows_applied_at_once():
            self.tables.send_lookups_ahead()

    def _exchange_buffers(self, step: int, progress: Progress) -> Progress:
        """After the gradients' trip: push the buffers (only with gradients that counted)."""
        if self.buffers is not None:
            if progress.dropped:
                self.buffers.pull()
            else:
                self.buffers.push(step)
        return progress

    def retune(self, hyperparameters: dict[str, Any]) -> None:
        """Every push from now on carries them; each shard retunes its rule before applying
        it (:mod:`tensorfleet.ps.pushed_hyperparameters`). Checked by the rule here first."""
        if self._rule is None:
            raise UsageError("register() the model before retuning its rule")
        self._rule.retuned(hyperparameters)
        self.client.hyperparameters = dict(hyperparameters)

    def skip(self, step: int) -> Progress:
        """async: push nothing and pull the newest values. sync: every step waits for its
        quota of workers, so this worker takes part with zero gradients."""
        if self.tables is not None:
            self.tables.discard()
        self._settle()
        if self.discipline is not None and self.discipline.mode == "async":
            pulled = self.pull()
            if self.tables is not None:  # nothing pushed: the rows are as they will be read
                self.tables.send_lookups_ahead()
            return Progress(pulled.global_step, pulled.stop, made_step=False, dropped=True)
        densify_sparse_gradients(self._named_params)
        zero_gradients(self._named_params)
        progress = self.client.push_pull(step=step)  # no rows: each table counts the step
        if self.mirrored is not None:
            self.mirrored.pull()
        progress = self._exchange_buffers(step, progress)
        self._send_held_lookups_ahead()
        return progress

    def agree(self, stop: bool, checkpoint: bool = False, preempted: bool = False) -> Agreement:
        return Agreement(stop, checkpoint, preempted)

    def save(
        self, data: DataPosition | None = None, tables_since: Sequence[dict] | None = None
    ) -> SavedState:
        """Every shard's state (the ps recorded each worker's data position with its
        pushes), and where each stored tensor belongs in the model."""
        self._settle()
        global_step, documents = self.client.save(tables_since)
        self._saved_step = global_step
        placement = {
            piece.stored_name: {
                "param": piece.variable.name,
                "rows": None if piece.is_whole else [piece.row_start, piece.row_stop],
                "shard": piece.shard,
            }
            for shard in self.plan.shards
            for piece in shard
        }
        if self.tables is not None:
            placement.update(self.tables.placement())
        if self.mirrored is not None:
            placement.update(self.mirrored.placement())
        return SavedState(global_step, documents, placement)

    def finish(self, before_done: Callable[[], object] | None, failed: bool = False) -> None:
        """Tell the shards this worker is done; the chief declares the end, waits for the
        others and runs ``before_done`` meanwhile (not after a failure: then it only tells
        them, so that they do not wait for it)."""
        self._settle(failed)
        if self.client.values_dtype is not None and not failed:
            self.client.pull()  # the model ends with the ps's exact values, not their rounding
        final = None if failed else before_done
        if final is not None:
            final = functools.partial(self._final_checkpoint, final)
        self.client.finish(declare_end=self.is_chief, before_done=final)

    def _final_checkpoint(self, before_done: Callable[[], object]) -> None:
        """``before_done`` (the chief's final checkpoint), unless the newest one saved is of
        the global step training ended at already (the last periodic one, no push since).
        Not for a model with table rows or buffers: their pushes follow a step's dense push
        as requests of their own, so they may have changed without the global step."""
        step = self.client.global_step_at_end
        only_dense = self.tables is None and self.mirrored is None and self.buffers is None
        if only_dense and step is not None and step == self._saved_step:
            log.info(
                "%s: the final checkpoint is the one of global step %d, saved already",
                self.client.task_name,
                step,
            )
            return
        before_done()

    def leave(self) -> None:
        """Tell every shard this worker left (preempted; not done): it counts as lost at
        once, and its restarted process takes over its identity at once."""
        self.client.leave()

    def close(self) -> None:
        if self.overlapped is not None:
            self.overlapped.close()
        if self.tables is not None:  # a lookup after the session: a UsageError with the fix
            self.tables.release("the ps shards")
        self.client.close()

    def stats(self) -> list[dict[str, Any]]:
        self._settle()
        return self.client.stats()

    def moving_average(self) -> dict[str, torch.Tensor]:
        self._settle()
        return self.client.moving_average()


def _without(plan: PlacementPlan, names: set[str]) -> PlacementPlan:
    """``plan`` with the variables ``names`` taken out (the others stay where they were)."""
    shards = tuple(tuple(s for s in shard if s.variable.name not in names) for shard in plan.shards)
    return PlacementPlan(plan.num_shards, plan.strategy, shards)
