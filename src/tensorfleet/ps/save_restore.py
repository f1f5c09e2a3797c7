"""A shard's ``save`` and ``restore``, and its update log. A mixin of
:class:`~tensorfleet.ps.service.ParameterService` (it acts on the service's store, global
step, workers' data positions and socket).

Rule. ``save`` answers with the shard's state as one safetensors document
(:mod:`tensorfleet.ps.checkpoint_handling`) and, with an update log
(:mod:`tensorfleet.ps.update_log`; ``ServiceSettings.update_log_dir``), starts the log's
next segment from that document. ``restore`` (and a ``create`` from a checkpoint) takes the
document's state, then replays the log's segment of that very document, when there is one:
the updates the shard applied after it, so that a shard whose process was killed comes back
at its last acknowledged push, not at the checkpoint. Every applied update is logged by
:meth:`SaveRestoreHandling._logging_update` around the store's apply: the record is written
on the log's thread while the store applies the update, and is whole before the push's
reply.

Invariant. After a restore the shard's values, optimizer state, version and global step are
those of the document followed by every complete record of its segment, in order; without a
segment for it (no log, the log of another checkpoint, an older one deleted) they are the
document's, as they were before the log existed, and the restore says what it could not
bring back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from tensorfleet.errors import CheckpointError, ConfigError, ProtocolError
from tensorfleet.ps import checkpoint_handling
from tensorfleet.ps.pushed_hyperparameters import FIELD, take_pushed
from tensorfleet.ps.shard_checkpoint import ShardState, decode_shard
from tensorfleet.ps.update_log import UpdateLog, shard_file_stem, snapshot_after_bytes
from tensorfleet.ps.update_log_room import missing_room
from tensorfleet.ps.update_log_segment import Base, Segment, checkpoint_id

if TYPE_CHECKING:
    from tensorfleet.ps.buffer_bank import BufferBank
    from tensorfleet.ps.service_settings import ServiceConfig
    from tensorfleet.ps.store import VariableStore
    from tensorfleet.ps.sync_aggregator import SyncAggregator
    from tensorfleet.ps.table_requests import TableRequests
    from tensorfleet.ps.update_discipline import UpdateDiscipline
    from tensorfleet.ps.worker_roster import WorkerRoster
    from tensorfleet.wire.service_socket import Request, ServiceSocket

log = logging.getLogger("tensorfleet.ps")


class SaveRestoreHandling:
    """A shard's checkpoints and update log, mixed into ``ParameterService`` (see the
    module), which provides the attributes below and ``_progress``."""

    config: ServiceConfig
    store: VariableStore
    socket: ServiceSocket
    global_step: int
    worker_data: dict[str, dict]
    buffer_bank: BufferBank
    tables: TableRequests
    aggregator: SyncAggregator | None
    roster: WorkerRoster
    discipline: UpdateDiscipline
    checkpointing_chief: str | None
    last_save_at: float | None
    update_log: UpdateLog | None
    owns_global_step: bool
    update_log_lacked_room: bool = False
    """Whether the update log was last refused for want of room (said once)."""

    def _open_update_log(self) -> None:
        """The shard's update log, when its settings name a directory."""
        directory = self.config.update_log_dir
        self.update_log = (
            None
            if directory is None
            else UpdateLog(directory, shard_file_stem(self.config.shard_index, self.config.model))
        )
        if self.update_log is not None:
            log.info(
                "%s: update log in %s (from the first checkpoint on, a ps killed with SIGKILL "
                "comes back at its last acknowledged push)",
                self.config.name,
                self.update_log.directory,
            )

    def close_update_log(self) -> None:
        """Close the update log's segment (it stays, for a later restore), giving back the
        space allocated ahead of its records: a process ending without it kept 64 MiB of
        ``/dev/shm`` per ps held by the last segment's file."""
        if self.update_log is not None:
            self.update_log.close()

    def _logging_update(
        self,
        gradients: list[torch.Tensor],
        global_step_after: int,
        part: tuple[int, int] | None = None,
        counts: bool = True,
        data: dict[str, Any] | None = None,
    ) -> AbstractContextManager[None]:
        """Log the update the block applies: its record (the version and ``global_step_after``
        it leaves) is written on the log's thread while the block applies it, and is whole
        when the block ends, before the push is answered; then a snapshot of the shard's
        dense state when the log's records since the last one call for it. A block that
        raises leaves no record. Without a log, a context that does nothing (every push of
        the apply loop enters it)."""
        if self.update_log is None or not self.update_log.open:
            return nullcontext()
        return self._logged_update(gradients, global_step_after, part, counts, data)

    @contextmanager
    def _logged_update(
        self,
        gradients: list[torch.Tensor],
        global_step_after: int,
        part: tuple[int, int] | None,
        counts: bool,
        data: dict[str, Any] | None,
    ) -> Iterator[None]:
        """:meth:`_logging_update` with a log."""
        assert self.update_log is not None
        pending = self.update_log.append_beside(
            [g.contiguous() for g in gradients],
            part,
            counts,
            self.store.version + (1 if counts else 0),
            global_step_after,
            data,
            dict(self.store.rule.hyperparameters) if self.store.rule is not None else None,
        )
        try:
            yield
        except BaseException:
            pending.undo()
            raise
        try:
            pending.wait()
            if self.update_log.wants_snapshot():  # the state the record leaves, as it leaves it
                pieces = checkpoint_handling.snapshot_pieces(
                    self.config.shard_index, self.store, global_step_after, self.worker_data
                )
                self.update_log.snapshot(pieces, self.store.version, global_step_after)
        except (OSError, CheckpointError) as exc:  # the update is applied: answer the push
            self.update_log.suspend()
            log.warning(
                "%s: the update log in %s could not be written (%s): it logs nothing more "
                "until the next checkpoint, and a ps killed before then comes back at the "
                "last update it did log; free space there or give the log another directory",
                self.config.name,
                self.update_log.directory,
                exc,
            )

    def _logging_push(
        self,
        gradients: list[torch.Tensor],
        body: dict[str, Any],
        global_step_after: int,
        part: tuple[int, int] | None = None,
        counts: bool = True,
    ) -> AbstractContextManager[None]:
        """:meth:`_logging_update` for one worker's push (whole or a bucket) with the data
        position it reported (``body["data"]``; none: no position), looked up only when the
        log is on."""
        data = None
        if self.update_log is not None and body.get("data") is not None:
            task = body.get("task")
            data = {task: self.worker_data[task]}
        return self._logging_update(gradients, global_step_after, part, counts, data)

    def _size_snapshots(self) -> int:
        """Set when the update log writes a snapshot: the shard's setting, or by default
        from the size of its dense state (values, moving average, optimizer state), whose
        bytes it returns."""
        assert self.update_log is not None
        values, ema, optimizer = self.store.checkpoint_parts(copy=False)
        tensors = [*values.values(), *(ema or {}).values()]
        tensors += [t for state in optimizer.values() for t in state.values()]
        state_bytes = sum(t.nbytes for t in tensors)
        setting = self.config.update_log_snapshot_bytes
        if setting is None:
            setting = snapshot_after_bytes(state_bytes)
        self.update_log.snapshot_after_bytes = setting or None
        return state_bytes

    def _log_has_room(self) -> bool:
        """Whether the update log may start (or go on) from here: its bound fits in the room
        its file system has (:mod:`tensorfleet.ps.update_log_room`). Without room the log
        stops until the next checkpoint asks again; the first refusal is logged with the
        figures and the fixes, a later start after one is logged too."""
        assert self.update_log is not None
        state_bytes = self._size_snapshots()
        reason = missing_room(
            self.update_log.directory,
            state_bytes,
            self.update_log.snapshot_after_bytes,
            self.update_log.held_bytes(),
            self.config.name,
        )
        if reason is not None:
            if not self.update_log_lacked_room:
                log.warning("%s", reason)
            self.update_log_lacked_room = True
            self.update_log.suspend()
            return False
        if self.update_log_lacked_room:
            log.warning(
                "%s: the update log in %s has room now: logging again from global step %d",
                self.config.name,
                self.update_log.directory,
                self.global_step,
            )
        self.update_log_lacked_room = False
        return True

    def _save(self, request: Request) -> None:
        """The shard's state as one safetensors document (a checkpoint's shard file); the
        update log starts a new segment from it."""
        self._require_initialized()  # type: ignore[attr-defined]
        document = checkpoint_handling.save_document(
            self.config.shard_index,
            self.store,
            self.global_step,
            self.worker_data,
            self.buffer_bank.values,
            self.tables.documents(request.body.get("tables_since")),
        )
        if self.update_log is not None and self._log_has_room():
            self.update_log.start(
                Base(
                    checkpoint_handling.live_checkpoint_id(
                        self.config.shard_index, self.store, self.global_step
                    ),
                    self.store.version,
                    self.global_step,
                )
            )
        answer: dict[str, object] = {"global_step": self.global_step, "version": self.store.version}
        if self.checkpoint_wanted:  # preempted: this is the checkpoint it waits for, then ends
            answer["ending"] = True  # (the chief's 'leave' need not wait for it)
        self.socket.reply(request, answer, [document])
        self.last_save_at = time.monotonic()

    def chief_saved_since(self, when: float) -> bool | None:
        """For a preemption drain: whether a checkpoint was saved after ``when``; None when
        none will come (no chief keeping checkpoints created the variables here, or it is
        done, or it left: preempted, its own checkpoint written). A chief lost by silence may
        come back within the drain's grace (a SIGSTOP ending, its warm spare taking over):
        False, keep waiting (:mod:`tensorfleet.ps.preemption_drain`)."""
        chief = self.checkpointing_chief
        if chief is None or chief in self.roster.done or chief in self.roster.left:
            return None
        return self.last_save_at is not None and self.last_save_at > when

    def _restore(self, request: Request) -> None:
        """Take the state of a shard document (every shard of a run is restored to the same
        checkpoint by the chief). Checked before anything changes."""
        self._require_initialized()  # type: ignore[attr-defined]
        checkpoint = checkpoint_handling.checked_checkpoint(
            self.config.shard_index,
            request.body,
            request.buffers,
            self.store.layout,
            self.store.rule.name,
        )
        checkpoint_handling.restore_into(self.store, checkpoint)
        self._take_progress(request.body.get("global_step"), checkpoint)
        self.socket.reply(request, self._progress())  # type: ignore[attr-defined]

    def _resume_step_of_recreated_shard(self, global_step: object) -> None:
        """A shard that restarted without a checkpoint is re-created by the chief from its
        current values at the global step the chief last saw: the step never goes back."""
        if not isinstance(global_step, int) or isinstance(global_step, bool) or global_step < 0:
            raise ProtocolError(f"'global_step' must be an integer >= 0, got {global_step!r}")
        self.global_step = global_step
        if self.aggregator is not None:
            self.aggregator.step = global_step

    def _take_progress(self, global_step: int, checkpoint: ShardState) -> None:
        """After a restore: the global step of the checkpoint (the same on every shard), the
        workers' data positions; sync gradients collected for a step that no longer exists
        are answered as dropped. Then the update log's segment of ``checkpoint``, replayed."""
        self.global_step = global_step
        self.worker_data = dict(checkpoint.worker_data)
        self.buffer_bank.take_checkpoint(
            checkpoint.buffers, "sync" if self.discipline.mode == "sync" else "async"
        )
        self.tables.restore(checkpoint.tables)
        if self.aggregator is not None:
            waiting = self.aggregator.waiting
            for contribution in waiting:
                self.aggregator.withdraw(contribution.task)
            self.aggregator.step = global_step
            for contribution in waiting:
                self._answer_push(contribution.request, made_step=False, dropped=True)  # type: ignore[attr-defined]
        log.warning(
            "%s: restored from a checkpoint at global step %d",
            self.config.name,
            global_step,
        )
        if self.update_log is not None:
            self._replay(checkpoint, global_step)

    def _replay(self, checkpoint: ShardState, global_step: int) -> None:
        """Replay the update log's segments from ``checkpoint`` on (found by its dense state,
        :func:`~tensorfleet.ps.update_log_segment.checkpoint_id`: a delta checkpoint's chain
        is restored merged), onto the restored state: a snapshot's state is taken as it is,
        each record applied in order."""
        assert self.update_log is not None
        self._size_snapshots()
        version = checkpoint.version
        crc = checkpoint_id(
            checkpoint.shard,
            checkpoint.global_step,
            version,
            checkpoint.values,
            checkpoint.ema,
            checkpoint.optimizer,
        )
        segments = self.update_log.find(crc)
        if not segments:
            log.warning(
                "%s: no update log of this checkpoint in %s: the updates since it are not "
                "replayed (logging again from here)",
                self.config.name,
                self.update_log.directory,
            )
            if self._log_has_room():
                self.update_log.start(Base(crc, version, global_step))
            return
        started, replayed, last = time.monotonic(), 0, None
        # The global step is this shard's own where it counts it (it owns it, or every sync
        # step does); elsewhere it is the one the restore gave.
        counts_steps = self.owns_global_step or self.aggregator is not None
        for segment in segments:
            if segment.snapshot is not None and not self._take_snapshot(segment, counts_steps):
                break
            if segment.base.version != self.store.version:
                log.error(
                    "%s: the update log %s starts at version %d, but the replay reached "
                    "version %d: it stops there",
                    self.config.name,
                    segment.path,
                    segment.base.version,
                    self.store.version,
                )
                break
            for update in segment.updates():
                if update.hyperparameters is not None:  # as it was applied (a schedule's)
                    take_pushed(self.store, {FIELD: update.hyperparameters}, self.config.name)
                self.store.apply(update.gradients, part=update.part, counts=update.counts)
                if counts_steps:
                    self.global_step = update.global_step
                if update.data:
                    self.worker_data.update(update.data)
                replayed += 1
            last = segment
            if segment.error is not None:
                log.error("%s: %s", self.config.name, segment.error)
                break
        if self.aggregator is not None:
            self.aggregator.step = self.global_step
        if last is None:  # the first segment's snapshot did not fit: log again from here
            if self._log_has_room():
                self.update_log.start(Base(crc, version, global_step))
            return
        self.update_log.continue_after(segments, last)
        self._log_has_room()  # (without room, it stops here: said once)
        taken = [s.path.name for s in segments if s.path.name <= last.path.name]
        log.warning(
            "%s: replayed %d updates of the update log (%s%s) in %.2f s: at global step %d, "
            "version %d (the checkpoint was at global step %d)",
            self.config.name,
            replayed,
            f"from a snapshot at global step {segments[0].base.global_step}, "
            if segments[0].snapshot is not None
            else "",
            ", ".join(taken),
            time.monotonic() - started,
            self.global_step,
            self.store.version,
            global_step,
        )

    def _take_snapshot(self, segment: Segment, counts_steps: bool) -> bool:
        """Bring the shard to a snapshot's state (values, moving average, optimizer state,
        version; the workers' data positions; the global step where this shard counts it).
        False, with the reason logged, when the snapshot does not fit this shard."""
        assert segment.snapshot is not None
        try:
            state = decode_shard(segment.snapshot)
            if state.shard != self.config.shard_index:
                raise ConfigError(f"it is of ps:{state.shard}, this is {self.config.name}")
            difference = self.store.layout.describe_difference(state.layout)
            if difference is not None:
                raise ConfigError(f"its variables differ: {difference}")
            checkpoint_handling.restore_into(self.store, state)
        except (ProtocolError, ConfigError) as exc:
            log.error(
                "%s: the update log's snapshot %s does not fit this shard (%s): the replay "
                "stops before it",
                self.config.name,
                segment.path,
                exc,
            )
            return False
        if counts_steps:
            self.global_step = state.global_step
        self.worker_data = dict(state.worker_data)
        return True
