"""A ps shard's update log: every update applied since its newest checkpoint, written before
the push that caused it is acknowledged, so that a shard whose process is killed (SIGKILL, the
OOM killer) is restored to its last acknowledged push, not to its last checkpoint.

Rule. An applied update (a whole push in ``async`` mode, a bucket of one, a push released by
the staleness gate, the mean of a ``sync`` step) is appended to the log while the store
applies it (on the log's own thread, :meth:`UpdateLog.append_beside`: the checksum and the
``write()`` release the GIL and only read the gradients, as the update does) and is whole
before its reply leaves; an update that raises leaves no record. A record holds the
gradients *as applied* (float32 after a bf16
wire's upcast, the ``sync`` mean after clipping), the part of the variables it covers,
whether it ended a worker's step (``version`` + 1), and the global step, version and data
position it left. A ``save`` starts a new *segment* whose first record names the checkpoint
it follows (its id: a hash of the shard's dense state in it,
:func:`~tensorfleet.ps.update_log_segment.checkpoint_id`, which a delta checkpoint's chain
merged for a restore holds too; and its version and global step). A ``restore`` (or a
``create`` from a checkpoint) finds the segment of the checkpoint it was given (by that
id), and replays its complete records
through the same ``VariableStore.apply`` in the same order.

Invariant. The shard after a restore and a replay holds, bit for bit, the values, optimizer
state and moving average of the killed process at its last logged update (the store's
update is a deterministic function of its state and the gradients on the same build and
thread count), with the same version and global step; every push a worker saw acknowledged
is in it, and a push logged but not acknowledged (the process died before its reply) is
applied once and dropped by its worker, as any push in flight is (never sent twice).

The segment files' format, and why XXH3-64: :mod:`tensorfleet.ps.update_log_segment`.

Snapshots. Without them a segment holds every push since its checkpoint: 200 steps x 6.5 MB
= 1.3 GB for the CNN with checkpoints every 200 global steps, 5.9 GB after 1,900 steps of the
example's default 500 (measured), and a restore replays every one of them (10-15 ms each: a
7-8 s restore in the storms). So once the records since the newest checkpoint or snapshot
hold :func:`snapshot_after_bytes` (by default four times the shard's dense state, at least
64 MiB; ``ServiceSettings.update_log_snapshot_bytes``), the shard writes a *snapshot*: a new
segment whose first record holds its dense state as a shard document (values, moving
average, optimizer state, version, global step, the workers' data positions; no tables or
buffers: those come back at the checkpoint, as the records' updates do) and the ids of
the two newest checkpoints (its *roots*). A restore of either starts at the newest segment
that starts for it (its own, or a snapshot naming it), takes the snapshot's state and
replays the records after it; every segment older than a snapshot is deleted once the
snapshot is whole in its file. So the log holds at most about a snapshot and
``snapshot_after_bytes`` of records, twice over around a checkpoint (the CNN: under 200 MB),
and a restore replays at most that many bytes of records (the CNN: 12 steps' pushes). Writing a
snapshot costs the shard's state once per ``snapshot_after_bytes`` logged (a quarter more
bytes written per push, by default). A snapshot's invariant is the replay's: its state is
bit for bit the shard's after the record before it (the records after it continue from
there), so a restore through a snapshot ends where one through every record would.

Space ahead. A thread keeps the current segment's next 32-64 MiB allocated past its last
record (:mod:`tensorfleet.ps.space_ahead`, ``fallocate`` keeping the file's size), so that a
logged push's ``write()`` lands on pages that exist: 2.3-2.4 instead of 4.7-5.0 ms for the
CNN's 6.5 MB in ``/dev/shm``.

What it covers, and what not. Data written with ``write()`` is in the page cache when it
returns, so a killed *process* loses nothing of it; a lost *host* (power, kernel panic)
loses what the kernel had not written to disk, so there the guarantee is the checkpoint's
(nothing is fsynced per push). The log holds the dense variables' updates; embedding-table
rows (``TableRequests``) and the persistent buffers of ``BufferBank`` come back at the
checkpoint, as before. What the log holds is bounded by its snapshots (above), not by the
checkpoint interval: for the CNN, 33 MB were left after 200 pushes (1.3 GB without
snapshots). A shard starts its log only where that bound fits in half the free space
(:mod:`tensorfleet.ps.update_log_room`). Each push pays for its record: the bytes written,
and on a machine whose cores the workers use the log's thread takes CPU from them (the CNN on
1 ps + 3 workers on 2 cores: 0.93x-0.98x the steps/s without it, docs/reliability.md).
``tensorfleet launch`` keeps the log by default in a directory of the launch in ``/dev/shm``
(:mod:`tensorfleet.launch.update_log_directory`); ``tensorfleet server --update-log DIR`` or
``TENSORFLEET_PS_UPDATE_LOG=DIR`` for a ps started by hand.

Why a log and not a standby. The other way to lose nothing is a standby shard that receives
and applies every push as the ps does: each push's gradients sent twice over the network and
every update computed twice, on the same cores as the workers (2 on the machine this was
measured on). The log costs one checksum and one ``write()`` of the gradient bytes per push
and nothing more unless a process dies. Measured (``benchmarks/recovery.py --only
update_log``, the CNN's 6.5 MB of gradients with Adam, against the same pushes to a ps
without the log in the same run, 2-core machine shared with other work): 19.2 ms a push
against 12.3 ms with the log in ``/dev/shm`` (1.56x), 32.1 against 11.8 ms on the disk
(2.72x); a restore replays about 13 ms per update, 0.7-3.9 s after the kills of a storm
(``benchmarks/chaos.py --ps-update-log``), where losing the steps since the checkpoint cost
up to 195 steps each to redo. A standby would pay its doubled traffic and computation on
every step to save those seconds. With XXH3-64 in place of CRC-32 (2026-11-28, the same
command, the commit before and after alternated): 14.3-16.7 ms a push with the log in
``/dev/shm`` against 18.5-21.7 ms before, 1.75-1.90x the push without it (2.24-2.54x).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from tensorfleet.errors import CheckpointError
from tensorfleet.ps.space_ahead import SpaceAhead
from tensorfleet.ps.update_log_room import bytes_on_disk
from tensorfleet.ps.update_log_segment import (
    XXH3_FORMAT,
    Base,
    Segment,
    UpdateLogCorrupt,
    encode_record,
)
from tensorfleet.wire.tensors import as_buffer, dtype_name

log = logging.getLogger("tensorfleet.ps")

SUFFIX = ".updatelog"
DELETION_WAIT_S = 10.0
"""How long a new deletion, or a close, waits for the one before it to end."""
WRITE_WAIT_S = 300.0
"""How long a push waits for its record's write before it fails (a disk that stopped)."""
_SEGMENT = re.compile(r"^(?P<shard>.+)\.(?P<seq>\d{8})\.updatelog$")


SNAPSHOT_STATE_MULTIPLE = 4
"""By default a snapshot is written once the records since the last one hold this many times
the shard's dense state (:func:`snapshot_after_bytes`)."""
SNAPSHOT_MIN_BYTES = 64 << 20
"""... and never before they hold this many bytes (a small shard's snapshots stay rare)."""


def snapshot_after_bytes(dense_state_bytes: int) -> int:
    """The default bytes of records after which a shard whose values, moving average and
    optimizer state take ``dense_state_bytes`` writes a snapshot: writing it costs
    ``1 / SNAPSHOT_STATE_MULTIPLE`` of the bytes logged since the one before (a quarter more
    written per push), and the log stays below about twice (the state + these records)."""
    return max(SNAPSHOT_MIN_BYTES, SNAPSHOT_STATE_MULTIPLE * dense_state_bytes)


def shard_file_stem(shard_index: int, model: str = "") -> str:
    """The name of a shard's segments before their sequence number (``ps-0``; a named model
    adds the CRC-32 of its name: any characters may be in it)."""
    stem = f"ps-{shard_index}"
    return stem if not model else f"{stem}.model-{zlib.crc32(model.encode()):08x}"


def _delete(paths: Sequence[Path]) -> None:
    """Delete ``paths``; one that cannot be is said (it stays: older than every start)."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("update log: could not delete the old segment %s: %s", path, exc)


class UpdateLog:
    """The segments of one shard (``stem``, :func:`shard_file_stem`) in ``directory``: the
    writer of the current one, and the finder of the ones a checkpoint's restore replays.

    ``snapshot_after_bytes``: once the records since the newest checkpoint or snapshot hold
    that many bytes, :meth:`wants_snapshot` says so and the shard writes a snapshot
    (:meth:`snapshot`), after which every older segment is deleted; None: never (the log
    then grows until the next checkpoint). See the module's "Snapshots"."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        stem: str,
        snapshot_after_bytes: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stem = stem
        self.snapshot_after_bytes = snapshot_after_bytes
        self._fd: int | None = None
        self._format = XXH3_FORMAT
        """The format of the segment being appended to (a new one: always XXH3_FORMAT)."""
        self.space_ahead: SpaceAhead | None = None
        """The space allocated ahead of the current segment's records (:mod:`space_ahead`)."""
        self._end = 0
        """Where the current segment's records end."""
        self.current: Path | None = None
        self.appended = 0
        """Updates appended by this process (for stats)."""
        self.snapshots = 0
        """Snapshots written by this process (for stats)."""
        self._checkpoints: list[int] = []
        """The ids of the two newest checkpoints, newest first: a restore may
        name either (the newest may never have been written), so the log keeps what both
        need, and a snapshot lists both as its roots."""
        self._latest_start: Path | None = None
        """The newest segment a restore of the newest checkpoint may start at (its own
        segment, or a snapshot after it)."""
        self._since_start = 0
        """Bytes of update records written since ``_latest_start`` began."""
        self._deleter: threading.Thread | None = None
        """The thread deleting the segments a snapshot or a checkpoint left behind."""
        self._largest_record = 0
        """The most bytes one update record took (for :meth:`_segment_limit`)."""
        self._writer: ThreadPoolExecutor | None = None
        """The thread that writes the records started with :meth:`append_beside`."""
        self._pending: PendingAppend | None = None
        """The record being written beside its update (None: none)."""

    def segments(self) -> list[tuple[int, Path]]:
        """This shard's segment files, oldest first, with their sequence numbers."""
        found = []
        for path in self.directory.iterdir():
            match = _SEGMENT.match(path.name)
            if match and match["shard"] == self.stem:
                found.append((int(match["seq"]), path))
        return sorted(found)

    @property
    def open(self) -> bool:
        """Whether a segment is open for records (none before the shard's first checkpoint,
        after :meth:`suspend` or :meth:`close`: updates are then not logged)."""
        return self._fd is not None

    def held_bytes(self) -> int:
        """The bytes this shard's segment files take on their file system (the space
        allocated ahead of the records included)."""
        return bytes_on_disk(path for _, path in self.segments())

    def start(self, base: Base) -> None:
        """Start a new segment after a checkpoint (``base``); keep what a restore of the
        checkpoint before it needs (the newest may never be written: from the newest segment
        that starts for that one, its own or a snapshot after it) and delete the rest."""
        self._settle()
        keep_from = self._latest_start
        self._new_segment({"kind": "base", **base.__dict__}, ())
        self._checkpoints = [base.document_crc, *self._checkpoints[:1]]
        self._delete_before(keep_from if keep_from is not None else self._previous_segment())

    def wants_snapshot(self) -> bool:
        """Whether the records since the newest checkpoint or snapshot hold
        ``snapshot_after_bytes`` or more (and a segment is open)."""
        self._settle()
        return (
            self._fd is not None
            and self.snapshot_after_bytes is not None
            and self._since_start >= self.snapshot_after_bytes
        )

    def snapshot(
        self, document: Sequence[bytes | memoryview], version: int, global_step: int
    ) -> None:
        """Start a new segment from a snapshot of the shard's dense state (``document``: the
        pieces of a shard document without tables or buffers, at ``version`` and
        ``global_step``, written one after the other and not copied first), then
        delete every older segment: a restore of either kept checkpoint starts here. The
        older segments go only after the snapshot is whole in its file (a process killed
        while writing it leaves a segment that does not open: the restore starts before
        it)."""
        self._settle()
        header = {
            "kind": "snapshot",
            "roots": list(self._checkpoints),
            "version": version,
            "global_step": global_step,
        }
        self._new_segment(header, [memoryview(piece).cast("B") for piece in document])
        self.snapshots += 1
        self._delete_before(self.current)

    def continue_after(self, chain: Sequence[Segment], last: Segment) -> None:
        """Append to ``last`` (the last segment of ``chain`` replayed) from its last good
        record (a torn tail or a corrupt record cut off), and delete the segments newer than
        it (not replayed: after a corrupt record, a history the shard has left). ``chain``
        (from :meth:`find`) tells which checkpoints the log keeps serving."""
        self._settle()
        for _, path in self.segments():
            if path.name > last.path.name:
                path.unlink(missing_ok=True)
        checkpoints: list[int] = []
        for segment in chain:
            if segment.snapshot is not None:
                checkpoints = list(segment.roots)
            else:
                checkpoints = [segment.base.document_crc, *checkpoints[:1]]
            self._latest_start = segment.path
            if segment is last:
                break
        self._checkpoints = checkpoints
        self._format = last.format  # appended in the format it started in
        self._open(last.path, truncate_at=last.valid_bytes)
        self._since_start = last.valid_bytes

    def find(self, crc: int) -> list[Segment]:
        """The segments to replay onto the checkpoint with id ``crc``: the newest
        segment a restore of it may start at (its own, or a snapshot taken after it), then
        each segment after it (a segment starts exactly where the one before it ends: at a
        ``save`` or a snapshot, between two updates), so that a restore of the checkpoint
        before the newest (the newest never written: its writer died) still comes back at
        the last update. Empty: no segment of that document (deleted, or never written).
        The chain stops at a segment that does not open."""
        segments = self.segments()
        opened: dict[Path, Segment | None] = {}  # each file opened (and a bad one said) once

        def segment(path: Path) -> Segment | None:
            if path not in opened:
                opened[path] = self._open_segment(path)
            return opened[path]

        for index in range(len(segments) - 1, -1, -1):
            first = segment(segments[index][1])
            if first is None or not first.starts_for(crc):
                continue
            chain = [first]
            for _, path in segments[index + 1 :]:
                following = segment(path)
                if following is None:
                    break
                chain.append(following)
            return chain
        return []

    def _new_segment(self, header: dict[str, Any], buffers: Sequence[memoryview]) -> None:
        existing = self.segments()
        seq = existing[-1][0] + 1 if existing else 0
        self._format = XXH3_FORMAT
        path = self.directory / f"{self.stem}.{seq:08d}{SUFFIX}"
        self._open(path, truncate_at=None, space_ahead=False)
        self._write(encode_record(header, buffers, self._format))
        self._latest_start = self.current
        self._since_start = 0
        # Only now: the thread's first fallocate holds the file while it allocates, and a
        # snapshot written meanwhile waited for it (64 instead of ~15 ms for the CNN's).
        self.space_ahead = SpaceAhead(self._fd, path, self._end, self._segment_limit())

    def _segment_limit(self) -> int | None:
        """Where the current segment is expected to end (None: unknown): its start, the
        records after which it gives way to a snapshot, and the largest record seen."""
        if self.snapshot_after_bytes is None:
            return None
        return self._end - self._since_start + self.snapshot_after_bytes + self._largest_record

    def _previous_segment(self) -> Path | None:
        """The segment before the current one (none kept yet in this process: the newest
        one on disk before it)."""
        existing = [path for _, path in self.segments() if path != self.current]
        return existing[-1] if existing else None

    def _delete_before(self, keep_from: Path | None) -> None:
        """Delete this shard's segments older than ``keep_from`` (None: none), on a thread of
        its own: freeing a segment's pages took 10 ms of a snapshot's 32 (the CNN's, in
        ``/dev/shm``), and nothing waits for it (a segment still there is older than every
        start :meth:`find` would choose)."""
        if keep_from is None:
            return
        old = [path for _, path in self.segments() if path.name < keep_from.name]
        if not old:
            return
        self.wait_for_deletions(DELETION_WAIT_S)
        self._deleter = threading.Thread(
            target=_delete, args=(old,), name="tensorfleet-update-log-delete", daemon=True
        )
        self._deleter.start()

    def wait_for_deletions(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the segments being deleted to be gone; whether they
        are."""
        if self._deleter is not None:
            self._deleter.join(timeout_s)
            if self._deleter.is_alive():
                return False
            self._deleter = None
        return True

    @staticmethod
    def _open_segment(path: Path) -> Segment | None:
        try:
            return Segment(path)
        except (UpdateLogCorrupt, OSError) as exc:
            log.warning("%s", exc)
            return None

    def append(
        self,
        gradients: Sequence[torch.Tensor],
        part: tuple[int, int] | None,
        counts: bool,
        version: int,
        global_step: int,
        data: dict[str, Any] | None = None,
        hyperparameters: dict[str, Any] | None = None,
    ) -> None:
        """Log one applied update (nothing when no segment is open: before the shard's first
        checkpoint, there is nothing to replay onto), with the rule's ``hyperparameters`` it
        was applied with (a worker's schedule changes them:
        :mod:`~tensorfleet.ps.pushed_hyperparameters`)."""
        if self._fd is None:
            return
        buffers = [as_buffer(g) for g in gradients]
        header = {
            "kind": "update",
            "part": None if part is None else list(part),
            "counts": counts,
            "version": version,
            "global_step": global_step,
            "data": data,
            "hyperparameters": hyperparameters,
            "buffers": [
                [dtype_name(g.dtype), b.nbytes] for g, b in zip(gradients, buffers, strict=True)
            ],
        }
        written = self._write(encode_record(header, buffers, self._format))
        self.appended += 1
        self._since_start += written
        self._largest_record = max(self._largest_record, written)

    def append_beside(
        self,
        gradients: Sequence[torch.Tensor],
        part: tuple[int, int] | None,
        counts: bool,
        version: int,
        global_step: int,
        data: dict[str, Any] | None = None,
        hyperparameters: dict[str, Any] | None = None,
    ) -> PendingAppend:
        """Start :meth:`append` on the log's writer thread and return at once, so that the
        shard applies the update while its record is checksummed and written (both release
        the GIL; neither changes ``gradients``, which the update only reads). The log must
        not be used again before :meth:`PendingAppend.wait` (or ``undo``) returns; every
        method of the log waits for it first."""
        self._settle()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="tensorfleet-update-log")
        mark = (self._end, self._since_start, self.appended)
        future = self._writer.submit(
            self.append, gradients, part, counts, version, global_step, data, hyperparameters
        )
        self._pending = PendingAppend(self, future, mark)
        return self._pending

    def _settle(self) -> None:
        """Wait for the append started beside an update, if one is pending."""
        if self._pending is not None:
            self._pending.wait()

    def suspend(self) -> None:
        """Log nothing more until the next checkpoint (:meth:`start`) or restore
        (:meth:`continue_after`): after an update that is applied but could not be logged
        (a full disk), a record after the gap would replay onto a state the shard never had.
        The segment stays as it is: a restore replays it to the update before the gap."""
        self.close()

    def close(self) -> None:
        """Close the current segment (it stays on disk), giving back the space allocated past
        its records (a truncation to its own size frees it), once the old segments being
        deleted are gone (at most :data:`DELETION_WAIT_S`)."""
        self._settle()
        self.wait_for_deletions(DELETION_WAIT_S)
        if self.space_ahead is not None:
            self.space_ahead.close()
            self.space_ahead = None
            try:
                os.ftruncate(self._fd, self._end)
            except OSError as exc:
                log.warning(
                    "update log %s: the space allocated past its records stays allocated until "
                    "the file is deleted: %s",
                    self.current,
                    exc,
                )
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self, path: Path, truncate_at: int | None, space_ahead: bool = True) -> None:
        self.close()
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate_at is None else 0)
        self._fd = os.open(path, flags, 0o600)
        if truncate_at is None:
            os.write(self._fd, self._format.magic)
            self._end = len(self._format.magic)
        else:
            os.ftruncate(self._fd, truncate_at)
            os.lseek(self._fd, truncate_at, os.SEEK_SET)
            self._end = truncate_at
        self.current = path
        if space_ahead:
            self.space_ahead = SpaceAhead(self._fd, path, self._end, self._segment_limit())

    def _write(self, pieces: list) -> int:
        """Write every piece, in order, in as few calls as the kernel allows; the bytes
        written."""
        views = [memoryview(p).cast("B") for p in pieces]
        total = sum(view.nbytes for view in views)
        while views:
            written = os.writev(self._fd, views)
            while views and written >= views[0].nbytes:
                written -= views[0].nbytes
                views.pop(0)
            if views and written:
                views[0] = views[0][written:]
        self._end += total
        if self.space_ahead is not None:
            self.space_ahead.wrote_to(self._end)
        return total


class PendingAppend:
    """A record being written beside its update (:meth:`UpdateLog.append_beside`)."""

    def __init__(self, log: UpdateLog, future: Future, mark: tuple[int, int, int]) -> None:
        self._log = log
        self._future = future
        self._mark = mark
        """The log's (records' end, bytes since its start, appended) before the record."""

    def wait(self) -> None:
        """Return once the record is written. What its write raised (an ``OSError`` of the
        disk) is raised here, the record cut off first (a torn record never stays before the
        next one); a write still going after :data:`WRITE_WAIT_S` is a ``CheckpointError``
        (the next record queues behind it on the same thread)."""
        if self._log._pending is not self:
            return
        self._log._pending = None
        try:
            self._future.result(WRITE_WAIT_S)
        except FutureTimeout as exc:
            raise CheckpointError(
                f"update log {self._log.current}: a record's write did not end within "
                f"{WRITE_WAIT_S:.0f} s (a disk that stopped answering?); the push is not "
                "answered"
            ) from exc
        except BaseException:
            self._cut()
            raise

    def undo(self) -> None:
        """The update was not applied after all (it raised): wait for the record, then cut it
        off the segment, as if it had never been started."""
        try:
            self.wait()
        finally:
            self._cut()

    def _cut(self) -> None:
        """Truncate the segment back to where it ended before this record (a write that
        failed part of the way may have put some of its bytes there). Not while the write
        still runs (past :data:`WRITE_WAIT_S`): it ends on its own."""
        if not self._future.done():
            return
        log_ = self._log
        end, since_start, appended = self._mark
        if log_._fd is not None:
            os.ftruncate(log_._fd, end)
            os.lseek(log_._fd, end, os.SEEK_SET)
        log_._end, log_._since_start, log_.appended = end, since_start, appended
