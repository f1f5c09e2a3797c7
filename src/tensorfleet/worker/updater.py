"""The ``Updater`` protocol: the one shape every update mode has, so that the training loop
(:class:`~tensorfleet.session.training_session.TrainingSession`) runs every mode alike.

An updater owns how a worker's gradients become updated parameters: through the parameter
servers (:class:`~tensorfleet.worker.ps_updater.PsUpdater`, modes ``async`` and ``sync``),
an all-reduce among the workers (:class:`~tensorfleet.worker.allreduce_updater.AllReduceUpdater`),
or in this one process (:class:`~tensorfleet.worker.local_updater.LocalUpdater`). The session
owns the loop, the hooks and *when* to checkpoint; the updater owns *how* (which documents, who
writes them, how a restore reaches every replica). A new mode is a new class implementing this
protocol plus one registration in :mod:`tensorfleet.session.update_modes`; the session needs no
change (docs/architecture.md, "Adding an update mode").

It lives in the worker layer so that the updaters can declare it without importing the
session. Checkpoints reach an updater through :class:`CheckpointSource`, which the session
implements over its checkpoint directory.

The life of an updater, as the session drives it::

    connect(device) -> wrap(model) -> register(params, rule) -> restore(source)
    -> pull() -> { agree(stop, checkpoint) ; exchange(step, data) | skip(step) ; save(data) }*
    -> finish(before_done) -> close()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from tensorfleet.errors import UsageError
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.worker.progress import Agreement, Progress

NamedParams = Sequence[tuple[str, torch.Tensor]]
"""The model's trainable parameters, by name (``model.named_parameters()`` order)."""

DataPosition = dict[str, Any]
"""A worker's place in its data (``BatchStream.state_dict()``), JSON-encodable."""


class StoredCheckpoint(Protocol):
    """A checkpoint as an updater reads it (the session's ``Checkpoint`` is one)."""

    @property
    def path(self) -> Path: ...

    @property
    def global_step(self) -> int: ...

    @property
    def documents(self) -> Sequence[bytes]: ...


class CheckpointSource(Protocol):
    """Where an updater finds the checkpoint to restore (the session implements it)."""

    def newest(self) -> StoredCheckpoint | None:
        """The newest valid checkpoint that fits this cluster, or None when there is none.
        Raises :class:`~tensorfleet.errors.CheckpointError` when the newest one cannot be
        restored here (e.g. another number of shards)."""
        ...

    def restoring(self, checkpoint: StoredCheckpoint) -> None:
        """Called once per restore, just before ``checkpoint`` is applied: the session
        reports it ("restoring checkpoint ...") and remembers it as the last checkpoint."""
        ...


@dataclass(frozen=True)
class Restored:
    """Where training starts, as :meth:`Updater.restore` left it."""

    global_step: int
    data: DataPosition | None = None
    """This worker's data position saved with the restored checkpoint (None: none saved)."""


@dataclass(frozen=True)
class SavedState:
    """A checkpoint's content, as :meth:`Updater.save` returns it for the session to write."""

    global_step: int
    documents: Sequence[bytes | bytearray | memoryview]
    """One safetensors document per shard (one in total for replicas and one process)."""
    placement: dict[str, dict[str, Any]]
    """Stored tensor name -> ``{"param": name, "rows": [start, stop] | None, "shard": i}``."""


def whole_placement(named_params: NamedParams) -> dict[str, dict[str, Any]]:
    """The placement of a one-document checkpoint: every parameter whole, in shard 0."""
    return {name: {"param": name, "rows": None, "shard": 0} for name, _ in named_params}


def retune_optimizer(
    optimizer: torch.optim.Optimizer | None,
    rule: UpdateRule | None,
    hyperparameters: dict[str, Any],
) -> None:
    """:meth:`Updater.retune` where the optimizer runs in this process (one process, each
    all-reduce worker): its parameter groups take ``hyperparameters``, checked by ``rule``."""
    if optimizer is None or rule is None:
        raise UsageError("register() the model before retuning its rule")
    retuned = rule.retuned(hyperparameters)
    for group in optimizer.param_groups:
        group.update(retuned.hyperparameters)


def zero_gradients(named_params: NamedParams) -> None:
    """Zero every gradient in place (a skipped step that must still take part)."""
    for _, param in named_params:
        if param.grad is not None:
            param.grad.zero_()


@runtime_checkable
class Updater(Protocol):
    """How one worker's gradients become updated parameters, in one mode.

    Every method is called from the training thread only. Methods marked *collective* must be
    called by every worker at the same point of the loop (the session sees to it).
    """

    discipline: UpdateDiscipline | None
    """The rule the parameter servers apply (None when no ps applies updates)."""

    collective: bool
    """Whether stopping and checkpoints must be agreed by all workers (:meth:`agree`) because
    :meth:`save` and the loop's end are collective. False: the chief saves whenever it likes."""

    def connect(self, device: torch.device | None = None) -> None:
        """Reach the rest of the cluster (``device``: where the model lives, which picks e.g.
        the collective backend; None: the CPU). Nothing to do in one process."""
        ...

    def wrap(self, model: nn.Module) -> nn.Module:
        """What the step closure must call: ``model`` itself, or a wrapper (DDP)."""
        ...

    def register(self, named_params: NamedParams, rule: UpdateRule) -> None:
        """Bind the trainable parameters and the update rule (builds local state; sends
        nothing)."""
        ...

    def restore(self, checkpoints: CheckpointSource | None, resume: bool = True) -> Restored:
        """Bring the variables to where training starts, once, after :meth:`register`: the
        newest checkpoint of ``checkpoints`` where this mode resumes from one (None, or
        ``resume`` False: do not resume), else the chief's initial values (the others wait
        for them or adopt them). *Collective* where :attr:`collective`. The source is kept
        for restores later in training (a ps that restarts empty), even without ``resume``."""
        ...

    def pull(self) -> Progress:
        """Bring the newest values into the model; the global step they belong to."""
        ...

    def exchange(self, step: int, data: DataPosition | None) -> Progress:
        """Apply this step's gradients (already in ``param.grad``) as the mode says and bring
        the updated values into the model. ``step``: the global step the gradients were
        computed at; ``data``: this worker's data position after their batch."""
        ...

    def retune(self, hyperparameters: dict[str, Any]) -> None:
        """Apply the update rule with ``hyperparameters`` (all of the rule's, some changed)
        from the next update on, keeping the optimizer state: the session's
        :class:`~tensorfleet.session.rule_optimizer.RuleOptimizer` changed them. ConfigError
        for one the rule does not take."""
        ...

    def skip(self, step: int) -> Progress:
        """What a vetoed update (a hook's ``before_update`` returned False) does in this
        mode: nothing is applied from this worker, but a mode in which every worker takes
        part in each step still takes part (with zero gradients)."""
        ...

    def agree(self, stop: bool, checkpoint: bool = False, preempted: bool = False) -> Agreement:
        """*Collective* where :attr:`collective`: whether any worker wants to stop, whether
        any wants a checkpoint now, and whether any was preempted. Elsewhere returns its
        arguments."""
        ...

    def save(
        self, data: DataPosition | None = None, tables_since: Sequence[dict] | None = None
    ) -> SavedState | None:
        """The checkpoint's content now (``data``: this worker's current data position;
        modes that record positions with each exchange use those). *Collective* where
        :attr:`collective`: there every worker calls it and the chief gets the content, the
        others None. Elsewhere only the chief calls it. ``tables_since``: per shard, the
        tags of the checkpoint written last, for delta documents of the embedding tables
        (:mod:`tensorfleet.ps.table_deltas`; modes without tables ignore it)."""
        ...

    def finish(self, before_done: Callable[[], object] | None, failed: bool = False) -> None:
        """The end of training for this worker: tell whoever waits for it. The chief runs
        ``before_done`` (the final checkpoint) while the rest of the cluster still serves
        (in a collective mode every worker runs it). ``failed``: the loop ended with an
        error; tell the others without waiting for anyone and without ``before_done``."""
        ...

    def leave(self) -> None:
        """This worker stops for now and will be back (it was preempted): tell whoever
        waits for it that it left, without saying it is done, so that nobody waits for it
        until its restarted process is back. Then :meth:`close`. Never raises for a peer
        that cannot be told (it will notice the silence)."""
        ...

    def close(self) -> None:
        """Release connections and threads (idempotent; after :meth:`finish` or a failure)."""
        ...

    def stats(self) -> list[dict[str, Any]]:
        """Each parameter server's own record; empty where there is none."""
        ...

    def moving_average(self) -> dict[str, torch.Tensor]:
        """The exponential moving average of the parameters by name (ValueError-derived
        :class:`~tensorfleet.errors.ConfigError` when none is kept)."""
        ...
