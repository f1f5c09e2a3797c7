"""``PsUpdater``: the parameter-server modes (``async``, ``sync``) as an
:class:`~tensorfleet.worker.updater.Updater`.

It owns what is particular to training through parameter servers, on top of the wire-level
:class:`~tensorfleet.worker.client.ParameterClient`: the placement plan (which shard holds
which variable), the update discipline the shards apply, who restores the shards (the chief:
at start when they are empty, and whenever one restarts empty during training), and what a
vetoed update means per discipline (async: push nothing; sync: push zeros, because every
step waits for its quota of workers), and the model's persistent buffers, which live on the
shards too (:mod:`tensorfleet.worker.buffer_exchange`).

With an :class:`~tensorfleet.worker.push_overlap.Overlap` (async mode without
``max_staleness``) the gradients go through a
:class:`~tensorfleet.worker.bucketed_push.BucketedPush` once the session drives it
(:meth:`PsUpdater.step_overlap`); every other operation first settles it, so that it sees
the exchange complete.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tensorfleet.errors import UsageError
from tensorfleet.ps.buffer_policies import persistent_buffers
from tensorfleet.ps.model_namespace import ModelClaim
from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.wire.message import Limits
from tensorfleet.worker.bucketed_push import BucketedPush, StepOverlap
from tensorfleet.worker.buffer_exchange import BufferExchange, place_buffers, placement_report
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.progress import Progress
from tensorfleet.worker.ps_row_source import PsRowSource
from tensorfleet.worker.push_overlap import Overlap
from tensorfleet.worker.sparse_gradient import densify_sparse_gradients
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


class PsUpdater:
    """One worker training through the ps shards at ``ps_addresses`` with ``plan`` and
    ``discipline``; ``is_chief``: this worker creates (or restores) the variables, saves the
    checkpoints and declares the end of training."""

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
        overlap: Overlap | None = None,
    ) -> None:
        self.client = ParameterClient(
            ps_addresses, secret, task_name, timeouts, limits=limits, encrypt=encrypt, model=model
        )
        self.is_chief = is_chief
        self.plan = plan
        self.discipline: UpdateDiscipline | None = discipline
        self._initialized: list[bool] = []
        self._named_params: list[tuple[str, torch.Tensor]] = []
        self._rule: UpdateRule | None = None
        self._log_placement = log_placement
        self.buffers: BufferExchange | None = None
        """The model's persistent buffers on the shards (None: the model has none)."""
        self.tables: TableAttachment | None = None
        """The model's embedding tables on the shards (None: the model has none)."""
        self._overlap = overlap if overlap is not None and overlap.active else None
        self._during_backward: bool | None = None
        """Set when the session drives the overlap: whether buckets may go in the backward."""
        self.overlapped: BucketedPush | None = None
        """The overlapped pushes, once registered (None: one push per shard, awaited)."""

    def connect(self, device: torch.device | None = None) -> None:
        """Say hello to every shard (the device does not matter: values travel via the CPU)."""
        self._initialized = self.client.connect()

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as it is; its persistent buffers are placed on the shards."""
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
        tables = find_tables(model)
        if tables:
            source = PsRowSource(
                lambda: self.client._shards,
                self.client._recovering,
                self.client.task_name,
                self.client.timeouts.step_s,
            )
            self.tables = TableAttachment(tables, source, self.client.num_shards)
        return model

    def register(self, named_params: NamedParams, rule: UpdateRule) -> None:
        self._named_params, self._rule = list(named_params), rule

    def restore(self, checkpoints: CheckpointSource | None, resume: bool = True) -> Restored:
        """The chief creates the variables, or, when the shards started empty and ``resume``,
        brings them to the newest checkpoint; the others wait for that. With
        ``checkpoints``, the chief also restores from them any shard that restarts empty
        later. Every worker gets back its data position as the ps recorded it."""
        if self._rule is None:
            raise UsageError("register() the model before restore()")
        resume_from = None
        if self.is_chief and checkpoints is not None:
            if resume and not all(self._initialized):
                resume_from = checkpoints.newest()  # the ps tasks started empty: resume
                if resume_from is not None:
                    checkpoints.restoring(resume_from)
            self.client.restore_shards = lambda: self._checkpoint_for_restarted(checkpoints)
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
        if self.tables is not None:
            self.tables.create(self._rule)
        if self.buffers is not None:
            mode = (
                "sync"
                if self.discipline is not None and self.discipline.mode == "sync"
                else "async"
            )
            self.buffers.create(mode, self.is_chief)
        if self._overlap is not None and self._during_backward is not None:
            self.overlapped = BucketedPush(
                self.client,
                self._named_params,
                self._overlap,
                hooks=self._during_backward and self._overlap.bucket_bytes is not None,
                # their exchanges follow each step's outcome: see push_overlap.py
                prefetch=self._overlap.prefetch and self.buffers is None and self.tables is None,
            )
        return Restored(global_step, self.client.restored_data)

    def step_overlap(self, during_backward: bool) -> StepOverlap:
        """The session drives the overlap of its steps (``during_backward``: nothing after
        the backward pass changes or vetoes the gradients, so buckets may go during it)."""
        if self._overlap is not None:
            self._during_backward = during_backward
        return StepOverlap(lambda: self.overlapped)

    def _settle(self, failed: bool = False) -> None:
        """Complete the overlapped exchange before any other operation."""
        if self.overlapped is not None:
            self.overlapped.settle(discard=failed)

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
        if self.buffers is not None:
            self.buffers.pull()
        return progress

    def trace(self, timeline: Timeline) -> None:
        """Record the exchanges with the shards (pack, push/pull, wait, unpack) in ``timeline``."""
        self.client.trace(timeline)

    def exchange(self, step: int, data: DataPosition | None) -> Progress:
        """Push the gradients (sparse ones, from ``sparse=True`` embeddings, as the dense
        gradient of their variable: see :func:`densify_sparse_gradients`) and the buffers."""
        densify_sparse_gradients(self._named_params)
        if self.tables is not None:
            sync = self.discipline is not None and self.discipline.mode == "sync"
            self.tables.push(sync_step=step if sync else None)
        if self.overlapped is not None:
            return self._exchange_buffers(step, self.overlapped.exchange(step, data))
        return self._exchange_buffers(step, self.client.push_pull(step=step, data=data))

    def _exchange_buffers(self, step: int, progress: Progress) -> Progress:
        """After the gradients' trip: push the buffers (only with gradients that counted)."""
        if self.buffers is not None:
            if progress.dropped:
                self.buffers.pull()
            else:
                self.buffers.push(step)
        return progress

    def skip(self, step: int) -> Progress:
        """async: push nothing and pull the newest values. sync: every step waits for its
        quota of workers, so this worker takes part with zero gradients."""
        if self.tables is not None:
            self.tables.discard()
        self._settle()
        if self.discipline is not None and self.discipline.mode == "async":
            pulled = self.pull()
            return Progress(pulled.global_step, pulled.stop, made_step=False, dropped=True)
        densify_sparse_gradients(self._named_params)
        zero_gradients(self._named_params)
        return self._exchange_buffers(step, self.client.push_pull(step=step))

    def agree(self, stop: bool, checkpoint: bool = False) -> tuple[bool, bool]:
        return stop, checkpoint

    def save(self, data: DataPosition | None = None) -> SavedState:
        """Every shard's state (the ps recorded each worker's data position with its
        pushes), and where each stored tensor belongs in the model."""
        self._settle()
        global_step, documents = self.client.save()
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
        return SavedState(global_step, documents, placement)

    def finish(self, before_done: Callable[[], object] | None, failed: bool = False) -> None:
        """Tell the shards this worker is done; the chief declares the end, waits for the
        others and runs ``before_done`` meanwhile (not after a failure: then it only tells
        them, so that they do not wait for it)."""
        self._settle(failed)
        self.client.finish(declare_end=self.is_chief, before_done=None if failed else before_done)

    def close(self) -> None:
        if self.overlapped is not None:
            self.overlapped.close()
        self.client.close()

    def stats(self) -> list[dict[str, Any]]:
        self._settle()
        return self.client.stats()

    def moving_average(self) -> dict[str, torch.Tensor]:
        self._settle()
        return self.client.moving_average()
