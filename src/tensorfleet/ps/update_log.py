"""A ps shard's update log: every update applied since its newest checkpoint, written before
the push that caused it is acknowledged, so that a shard whose process is killed (SIGKILL, the
OOM killer) is restored to its last acknowledged push, not to its last checkpoint.

Rule. An applied update (a whole push in ``async`` mode, a bucket of one, a push released by
the staleness gate, the mean of a ``sync`` step) is appended to the log after the store
applied it and before its reply leaves: the gradients *as applied* (float32 after a bf16
wire's upcast, the ``sync`` mean after clipping), the part of the variables it covers,
whether it ended a worker's step (``version`` + 1), and the global step, version and data
position it left. A ``save`` starts a new *segment* whose first record names the checkpoint
it follows (the CRC-32 of the shard document the save answered with, and that document's
version and global step). A ``restore`` (or a ``create`` from a checkpoint) finds the
segment of the document it was given (by that CRC-32), and replays its complete records
through the same ``VariableStore.apply`` in the same order.

Invariant. The shard after a restore and a replay holds, bit for bit, the values, optimizer
state and moving average of the killed process at its last logged update (the store's
update is a deterministic function of its state and the gradients on the same build and
thread count), with the same version and global step; every push a worker saw acknowledged
is in it, and a push logged but not acknowledged (the process died before its reply) is
applied once and dropped by its worker, as any push in flight is (never sent twice).

The format (never pickle; never trust the bytes): a segment file starts with
:data:`MAGIC`; each record is ``b"TFUR"``, the payload's length and its CRC-32 (``<4sII``),
then the payload: a msgpack header's length (``<I``), the header, and the gradients' raw
bytes (the header lists each buffer's dtype and length). A record cut short (the process
died inside its write) is a *torn tail*: dropped, and the file truncated there before the
next append; that push was never acknowledged. A record whose CRC does not match, or whose
header or buffers do not parse, is :class:`UpdateLogCorrupt`, naming the file and offset:
the records before it are replayed, the rest is not (the restore says so, with the steps
it could not bring back).

What it covers, and what not. Data written with ``write()`` is in the page cache when it
returns, so a killed *process* loses nothing of it; a lost *host* (power, kernel panic)
loses what the kernel had not written to disk, so there the guarantee is the checkpoint's
(nothing is fsynced per push). The log holds the dense variables' updates; embedding-table
rows (``TableRequests``) and the persistent buffers of ``BufferBank`` come back at the
checkpoint, as before. A segment holds at most (pushes between two checkpoints) x (the
shard's gradient bytes per push): 200 steps x 6.5 MB = 1.3 GB for the CNN example with
checkpoints every 200 global steps; two segments are kept (the newest checkpoint's and the
one before, in case the newest was never written), older ones are deleted at each ``save``.
So the log is opt-in: ``tensorfleet server --update-log DIR``, ``tensorfleet launch
--ps-update-log DIR``, or ``TENSORFLEET_PS_UPDATE_LOG=DIR`` (docs/reliability.md).

Why a log and not a standby. The other way to lose nothing is a standby shard that receives
and applies every push as the ps does: each push's gradients sent twice over the network and
every update computed twice, on the same cores as the workers (2 on the machine this was
measured on). The log costs one CRC-32 and one ``write()`` of the gradient bytes per push
(``benchmarks/recovery.py``'s ``update_log`` row measures it against the same pushes
without the log), and nothing when no process dies.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from tensorfleet.errors import CheckpointError
from tensorfleet.wire.tensors import DTYPES, as_buffer, dtype_name

log = logging.getLogger("tensorfleet.ps")

MAGIC = b"TFUPDATELOG1\n"
"""The first bytes of every segment file."""
RECORD = struct.Struct("<4sII")
"""A record's prefix: ``b"TFUR"``, the payload's length, its CRC-32."""
RECORD_TAG = b"TFUR"
HEADER_LENGTH = struct.Struct("<I")
SUFFIX = ".updatelog"
_SEGMENT = re.compile(r"^(?P<shard>.+)\.(?P<seq>\d{8})\.updatelog$")


class UpdateLogCorrupt(CheckpointError):
    """A complete record of an update log whose bytes are not what was written."""


@dataclass(frozen=True)
class Base:
    """The checkpoint a segment follows: its shard document's CRC-32, version, global step."""

    document_crc: int
    version: int
    global_step: int


@dataclass(frozen=True)
class Update:
    """One applied update, as logged: what :meth:`VariableStore.apply` was given, and the
    progress it left (``version``, ``global_step``; ``data``: the worker's data position it
    carried, ``{task: position}``, or None)."""

    gradients: list[torch.Tensor]
    part: tuple[int, int] | None
    counts: bool
    version: int
    global_step: int
    data: dict[str, Any] | None = None


@dataclass(frozen=True)
class Segment:
    """What a segment file holds: its base, its complete records, and where the valid bytes
    end (``valid_bytes``; less than the file's size after a torn tail or a corrupt record,
    which ``error`` then describes)."""

    path: Path
    base: Base
    updates: list[Update]
    valid_bytes: int
    error: UpdateLogCorrupt | None = None


def document_crc(document: bytes | memoryview) -> int:
    """The CRC-32 that names a shard document (a checkpoint's shard file)."""
    return zlib.crc32(document)


def shard_file_stem(shard_index: int, model: str = "") -> str:
    """The name of a shard's segments before their sequence number (``ps-0``; a named model
    adds the CRC-32 of its name: any characters may be in it)."""
    stem = f"ps-{shard_index}"
    return stem if not model else f"{stem}.model-{zlib.crc32(model.encode()):08x}"


def encode_record(header: dict[str, Any], buffers: Sequence[memoryview] = ()) -> list[bytes]:
    """One record as the pieces to write in order (prefix, header length and header, the
    buffers, uncopied). The CRC covers the whole payload."""
    packed = msgpack.packb(header, use_bin_type=True)
    head = HEADER_LENGTH.pack(len(packed)) + packed
    crc = zlib.crc32(head)
    for buffer in buffers:
        crc = zlib.crc32(buffer, crc)
    length = len(head) + sum(b.nbytes for b in buffers)
    return [RECORD.pack(RECORD_TAG, length, crc) + head, *buffers]


def _corrupt(path: Path, offset: int, what: str) -> UpdateLogCorrupt:
    return UpdateLogCorrupt(
        f"update log {path}: the record at byte offset {offset} {what}; the updates from there "
        "on are not replayed (the shard comes back at the last good record before it)"
    )


def _records(path: Path, data: memoryview) -> Iterator[tuple[int, dict, list[memoryview]]]:
    """(offset, header, buffers) of each complete record of ``data``; stops at a torn tail;
    raises :class:`UpdateLogCorrupt` for a complete record that does not check."""
    offset = len(MAGIC)
    while offset + RECORD.size <= len(data):
        tag, length, crc = RECORD.unpack_from(data, offset)
        if tag != RECORD_TAG:
            raise _corrupt(path, offset, f"starts with {bytes(tag)!r}, not {RECORD_TAG!r}")
        start = offset + RECORD.size
        if start + length > len(data):
            return  # a torn tail: the write was cut short
        payload = data[start : start + length]
        if zlib.crc32(payload) != crc:
            raise _corrupt(path, offset, f"fails its CRC-32 ({length} bytes)")
        try:
            (size,) = HEADER_LENGTH.unpack_from(payload, 0)
            header = msgpack.unpackb(payload[4 : 4 + size], raw=False)
            buffers, at = [], 4 + size
            for _, nbytes in header.get("buffers", []):
                buffers.append(payload[at : at + nbytes])
                at += nbytes
        except (ValueError, TypeError, struct.error, msgpack.ExtraData) as exc:
            raise _corrupt(path, offset, f"does not parse: {exc}") from exc
        if not isinstance(header, dict) or at != length:
            raise _corrupt(path, offset, "does not parse: its buffers do not fill it")
        yield offset, header, buffers
        offset = start + length


def read_segment(path: Path) -> Segment:
    """The segment at ``path``. A torn tail is dropped (``valid_bytes`` ends before it); a
    corrupt record ends the records read there and is kept in ``error``. A file that does not
    start with :data:`MAGIC` and a base record is :class:`UpdateLogCorrupt` (raised)."""
    data = memoryview(path.read_bytes())
    if bytes(data[: len(MAGIC)]) != MAGIC:
        raise _corrupt(path, 0, f"is not an update log (it starts with {bytes(data[:16])!r})")
    base: Base | None = None
    updates: list[Update] = []
    valid = len(MAGIC)
    error: UpdateLogCorrupt | None = None
    try:
        for offset, header, buffers in _records(path, data):
            if base is None:
                if header.get("kind") != "base":
                    raise _corrupt(path, offset, "is not the segment's base record")
                base = Base(header["document_crc"], header["version"], header["global_step"])
            else:
                updates.append(_update(path, offset, header, buffers))
            valid = offset + RECORD.size + RECORD.unpack_from(data, offset)[1]
    except UpdateLogCorrupt as exc:
        if base is None:
            raise
        error = exc
    if base is None:
        raise _corrupt(path, len(MAGIC), "is missing: the segment has no base record")
    return Segment(path, base, updates, valid, error)


def _update(path: Path, offset: int, header: dict, buffers: list[memoryview]) -> Update:
    try:
        gradients = [
            torch.frombuffer(bytearray(buffer), dtype=DTYPES[name])
            if buffer.nbytes
            else torch.empty(0, dtype=DTYPES[name])
            for (name, _), buffer in zip(header["buffers"], buffers, strict=True)
        ]
        part = header["part"]
        return Update(
            gradients,
            None if part is None else (int(part[0]), int(part[1])),
            bool(header["counts"]),
            int(header["version"]),
            int(header["global_step"]),
            header.get("data"),
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise _corrupt(path, offset, f"is not an update: {exc!r}") from exc


class UpdateLog:
    """The segments of one shard (``stem``, :func:`shard_file_stem`) in ``directory``: the
    writer of the current one, and the finder of the one a checkpoint's document starts."""

    def __init__(self, directory: str | os.PathLike[str], stem: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stem = stem
        self._fd: int | None = None
        self.current: Path | None = None
        self.appended = 0
        """Updates appended by this process (for stats)."""

    def segments(self) -> list[tuple[int, Path]]:
        """This shard's segment files, oldest first, with their sequence numbers."""
        found = []
        for path in self.directory.iterdir():
            match = _SEGMENT.match(path.name)
            if match and match["shard"] == self.stem:
                found.append((int(match["seq"]), path))
        return sorted(found)

    def start(self, base: Base) -> None:
        """Start a new segment after a checkpoint (``base``); keep the one before it (the
        newest checkpoint may never have been written) and delete the older ones."""
        existing = self.segments()
        seq = existing[-1][0] + 1 if existing else 0
        self._open(self.directory / f"{self.stem}.{seq:08d}{SUFFIX}", truncate_at=None)
        self._write(encode_record({"kind": "base", **base.__dict__}))
        for _, path in existing[:-1]:
            path.unlink(missing_ok=True)

    def continue_after(self, segment: Segment) -> None:
        """Append to ``segment`` (the last one replayed) from its last good record (a torn
        tail or a corrupt record cut off), and delete the segments newer than it (not
        replayed: after a corrupt record, a history the shard has left)."""
        for _, path in self.segments():
            if path.name > segment.path.name:
                path.unlink(missing_ok=True)
        self._open(segment.path, truncate_at=segment.valid_bytes)

    def find(self, crc: int) -> list[Segment]:
        """The segments to replay onto the shard document with CRC-32 ``crc``: the newest
        segment whose base it is, then each segment after it (a segment starts exactly where
        the one before it ends: at a ``save``, between two updates), so that a restore of the
        checkpoint before the newest (the newest never written: its writer died) still comes
        back at the last update. Empty: no segment of that document (deleted, or never
        written). The chain stops at a segment that does not read, or after a corrupt one."""
        segments = self.segments()
        for index in range(len(segments) - 1, -1, -1):
            first = self._read(segments[index][1])
            if first is None or first.base.document_crc != crc:
                continue
            chain = [first]
            for _, path in segments[index + 1 :]:
                following = self._read(path) if chain[-1].error is None else None
                if following is None:
                    break
                chain.append(following)
            return chain
        return []

    @staticmethod
    def _read(path: Path) -> Segment | None:
        try:
            return read_segment(path)
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
    ) -> None:
        """Log one applied update (nothing when no segment is open: before the shard's first
        checkpoint, there is nothing to replay onto)."""
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
            "buffers": [
                [dtype_name(g.dtype), b.nbytes] for g, b in zip(gradients, buffers, strict=True)
            ],
        }
        self._write(encode_record(header, buffers))
        self.appended += 1

    def close(self) -> None:
        """Close the current segment (it stays on disk)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self, path: Path, truncate_at: int | None) -> None:
        self.close()
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate_at is None else 0)
        self._fd = os.open(path, flags, 0o600)
        if truncate_at is None:
            os.write(self._fd, MAGIC)
        else:
            os.ftruncate(self._fd, truncate_at)
            os.lseek(self._fd, truncate_at, os.SEEK_SET)
        self.current = path

    def _write(self, pieces: list) -> None:
        """Write every piece, in order, in as few calls as the kernel allows."""
        views = [memoryview(p).cast("B") for p in pieces]
        while views:
            written = os.writev(self._fd, views)
            while views and written >= views[0].nbytes:
                written -= views[0].nbytes
                views.pop(0)
            if views and written:
                views[0] = views[0][written:]
