"""A training session's checkpoint directory as the updaters read it when they restore: the
newest valid checkpoint that fits this session (its model's name, the cluster's number of ps
tasks), and the one report of a restore.

A role of its own, split out of :mod:`tensorfleet.session.training_session`: the updaters ask
for the checkpoint to restore (:class:`~tensorfleet.worker.updater.CheckpointSource`) at the
start and again when a restarted ps must be restored, and the checks say what does not fit
before anything is restored from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorfleet.errors import CheckpointError
from tensorfleet.ps.model_namespace import label
from tensorfleet.session.checkpoints import Checkpoint
from tensorfleet.worker.updater import StoredCheckpoint

if TYPE_CHECKING:
    from tensorfleet.session.training_session import TrainingSession


class SessionCheckpoints:
    """The newest valid checkpoint of ``session``'s directory that fits it, and the report
    of its restore."""

    def __init__(self, session: TrainingSession) -> None:
        self._session = session

    def newest(self) -> Checkpoint | None:
        assert self._session.checkpoints is not None
        checkpoint = self._session.checkpoints.newest_valid()
        if checkpoint is not None:
            self._check_model(checkpoint)
            self._check_shard_count(checkpoint)
        return checkpoint

    def restoring(self, checkpoint: StoredCheckpoint) -> None:
        session = self._session
        print(
            f"{session.task_name}: restoring checkpoint {checkpoint.path} (global step "
            f"{checkpoint.global_step})",
            flush=True,
        )
        session.last_checkpoint = checkpoint.path
        session._deltas.reset()  # restored tables are new incarnations: the next one is full

    def _check_model(self, checkpoint: Checkpoint) -> None:
        model, mine = checkpoint.manifest.get("model", ""), self._session.model_name
        if model != mine:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} belongs to {label(model)}, this session trains "
                f"{label(mine)}: give each model its own checkpoint_dir (a named "
                "model saves under checkpoint_dir/<model_name>)"
            )

    def _check_shard_count(self, checkpoint: Checkpoint) -> None:
        server = self._session.server
        shards = len(server.ps_addresses) if server is not None else 1
        shards = shards or 1  # allreduce: the chief's replica is the one shard
        if len(checkpoint.documents) != shards:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} has {len(checkpoint.documents)} shard files, the "
                f"cluster has {shards} ps tasks: restore it with the same number of ps tasks, "
                "or start fresh (restore=False; the example's --fresh)"
            )
