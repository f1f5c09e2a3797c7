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
:data:`MAGIC`; each record is ``b"TFUR"``, the payload's length and its XXH3-64 checksum
(``<4sIQ``), then the payload: a msgpack header's length (``<I``), the header, and the
gradients' raw bytes (the header lists each buffer's dtype and length). A record cut short
(the process died inside its write) is a *torn tail*: dropped, and the file truncated there
before the next append; that push was never acknowledged. A record whose checksum does not
match, or whose header or buffers do not parse, is :class:`UpdateLogCorrupt`, naming the
file and offset: the records before it are replayed, the rest is not (the restore says so,
with the steps it could not bring back).

Segments of the first format (:data:`MAGIC_CRC32`, each record's payload checked by a CRC-32
in a ``<4sII`` prefix), written before the checksum changed, are still read and replayed
(a ps upgraded between two checkpoints loses nothing); a segment is appended to in the
format it started in. Why XXH3-64 and not CRC-32 (:class:`RecordFormat`): the checksum is
computed over every byte of every push before its reply leaves, and zlib's CRC-32 ran at
2.3 GB/s here (3.0-3.7 ms of the 8 ms an append of the CNN's 6.5 MB took, the rest the
``write()``), XXH3-64 at 24 GB/s (0.35 ms per 8 MiB); both catch the damage the check is for
(a torn or altered record of our own file: this is not a MAC, the file's writer is trusted).
CRC-32C with the CPU's instruction was measured too (0.48-0.56 ms per 8 MiB): its Python
packages either take only ``bytes`` (a copy of every push) or are LGPL.

Space ahead. A thread keeps the current segment's next 32-64 MiB allocated past its last
record (:mod:`tensorfleet.ps.space_ahead`, ``fallocate`` keeping the file's size), so that a
logged push's ``write()`` lands on pages that exist: 2.3-2.4 instead of 4.7-5.0 ms for the
CNN's 6.5 MB in ``/dev/shm``.

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
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch
import xxhash

from tensorfleet.errors import CheckpointError
from tensorfleet.ps.space_ahead import SpaceAhead
from tensorfleet.wire.tensors import DTYPES, as_buffer, dtype_name

log = logging.getLogger("tensorfleet.ps")

MAGIC = b"TFUPDATELOG2\n"
"""The first bytes of every segment file written now (records checked by XXH3-64)."""
MAGIC_CRC32 = b"TFUPDATELOG1\n"
"""The first bytes of a segment of the first format (records checked by CRC-32): read only."""
RECORD_TAG = b"TFUR"
HEADER_LENGTH = struct.Struct("<I")
SUFFIX = ".updatelog"
_SEGMENT = re.compile(r"^(?P<shard>.+)\.(?P<seq>\d{8})\.updatelog$")


class UpdateLogCorrupt(CheckpointError):
    """A complete record of an update log whose bytes are not what was written."""


def _xxh3_64(pieces: Sequence[bytes | memoryview]) -> int:
    """The XXH3-64 of ``pieces`` one after the other (no copy of them)."""
    state = xxhash.xxh3_64()
    for piece in pieces:
        state.update(piece)
    return state.intdigest()


def _crc32(pieces: Sequence[bytes | memoryview]) -> int:
    """The CRC-32 of ``pieces`` one after the other (no copy of them)."""
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return crc


@dataclass(frozen=True)
class RecordFormat:
    """How a segment's records are framed and checked: the segment's first bytes, the
    record prefix (``b"TFUR"``, the payload's length, its checksum) and the checksum (of the
    payload's pieces, one after the other), named in the errors."""

    magic: bytes
    prefix: struct.Struct
    checksum_name: str
    checksum: Callable[[Sequence[bytes | memoryview]], int]


#: Every segment is written in this format.
XXH3_FORMAT = RecordFormat(MAGIC, struct.Struct("<4sIQ"), "XXH3-64", _xxh3_64)
#: Segments written before the checksum changed: still read and appended to.
CRC32_FORMAT = RecordFormat(MAGIC_CRC32, struct.Struct("<4sII"), "CRC-32", _crc32)
FORMATS = {f.magic: f for f in (XXH3_FORMAT, CRC32_FORMAT)}
#: A record's prefix in the format segments are written in.
RECORD = XXH3_FORMAT.prefix


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


def document_crc(document: bytes | memoryview) -> int:
    """The CRC-32 that names a shard document (a checkpoint's shard file)."""
    return zlib.crc32(document)


def shard_file_stem(shard_index: int, model: str = "") -> str:
    """The name of a shard's segments before their sequence number (``ps-0``; a named model
    adds the CRC-32 of its name: any characters may be in it)."""
    stem = f"ps-{shard_index}"
    return stem if not model else f"{stem}.model-{zlib.crc32(model.encode()):08x}"


def encode_record(
    header: dict[str, Any],
    buffers: Sequence[memoryview] = (),
    record_format: RecordFormat = XXH3_FORMAT,
) -> list[bytes]:
    """One record as the pieces to write in order (prefix, header length and header, the
    buffers, uncopied). The checksum covers the whole payload."""
    packed = msgpack.packb(header, use_bin_type=True)
    head = HEADER_LENGTH.pack(len(packed)) + packed
    checksum = record_format.checksum([head, *buffers])
    length = len(head) + sum(b.nbytes for b in buffers)
    return [record_format.prefix.pack(RECORD_TAG, length, checksum) + head, *buffers]


class Segment:
    """One segment file, read as a stream: its base record at once (a file that does not
    start with :data:`MAGIC` and a base record is :class:`UpdateLogCorrupt`, raised), then
    :meth:`updates` one record at a time (one record in memory at a time: a segment may hold
    gigabytes). After :meth:`updates` ends, ``valid_bytes`` is where the last good record
    ends (less than the file's size after a torn tail or a corrupt record) and ``error``
    describes a corrupt record (None: none)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.error: UpdateLogCorrupt | None = None
        with open(path, "rb") as file:
            magic = file.read(len(MAGIC))
            record_format = FORMATS.get(magic)
            if record_format is None:
                raise _corrupt(path, 0, f"is not an update log (it starts with {magic[:16]!r})")
            self.format = record_format
            first = _read_record(
                path, file, len(MAGIC), os.fstat(file.fileno()).st_size, record_format
            )
        if first is None or first[0].get("kind") != "base":
            raise _corrupt(path, len(MAGIC), "is not the segment's base record")
        header, _, self.valid_bytes = first
        try:
            self.base = Base(
                int(header["document_crc"]), int(header["version"]), int(header["global_step"])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise _corrupt(path, len(MAGIC), f"is not a base record: {exc!r}") from exc

    def updates(self) -> Iterator[Update]:
        """The segment's complete update records, in order; stops at a torn tail (dropped)
        or at a corrupt record (kept in ``error``)."""
        with open(self.path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            offset = self.valid_bytes
            file.seek(offset)
            while True:
                try:
                    record = _read_record(self.path, file, offset, size, self.format)
                    if record is None:
                        return  # a torn tail, or the end
                    header, payload, end = record
                    update = _update(self.path, offset, header, payload)
                except UpdateLogCorrupt as exc:
                    self.error = exc
                    return
                yield update
                self.valid_bytes = offset = end


def _corrupt(path: Path, offset: int, what: str) -> UpdateLogCorrupt:
    return UpdateLogCorrupt(
        f"update log {path}: the record at byte offset {offset} {what}; the updates from there "
        "on are not replayed (the shard comes back at the last good record before it)"
    )


def _read_record(
    path: Path, file: Any, offset: int, size: int, record_format: RecordFormat
) -> tuple[dict, memoryview, int] | None:
    """The record at ``offset`` of ``file`` (positioned there; ``size`` bytes long): its
    header, its payload and where it ends; None for a torn tail (cut short: the write never
    finished) or the end of the file. A complete record that does not check is
    :class:`UpdateLogCorrupt`."""
    prefix_struct = record_format.prefix
    prefix = file.read(prefix_struct.size)
    if len(prefix) < prefix_struct.size:
        return None
    tag, length, checksum = prefix_struct.unpack(prefix)
    if tag != RECORD_TAG:
        raise _corrupt(path, offset, f"starts with {tag!r}, not {RECORD_TAG!r}")
    end = offset + prefix_struct.size + length
    if end > size:
        return None  # cut short (and never more memory than the file holds)
    payload = bytearray(length)
    if file.readinto(payload) != length:
        return None
    if record_format.checksum([payload]) != checksum:
        raise _corrupt(path, offset, f"fails its {record_format.checksum_name} ({length} bytes)")
    view = memoryview(payload)
    try:
        (header_size,) = HEADER_LENGTH.unpack_from(view, 0)
        header = msgpack.unpackb(view[4 : 4 + header_size], raw=False)
    except (ValueError, TypeError, struct.error, msgpack.ExtraData) as exc:
        raise _corrupt(path, offset, f"does not parse: {exc}") from exc
    if not isinstance(header, dict):
        raise _corrupt(path, offset, "does not parse: its header is not a map")
    return header, view[4 + header_size :], end


def _update(path: Path, offset: int, header: dict, payload: memoryview) -> Update:
    """The update of a record (its gradients are views of ``payload``: no copy)."""
    try:
        if header.get("kind") != "update":
            raise _corrupt(path, offset, f"is not an update: kind {header.get('kind')!r}")
        gradients, at = [], 0
        for name, nbytes in header["buffers"]:
            dtype = DTYPES[name]
            itemsize = dtype.itemsize
            if nbytes % itemsize or at + nbytes > payload.nbytes:
                raise _corrupt(
                    path,
                    offset,
                    f"is not an update: {nbytes} bytes of {name} at {at} of {payload.nbytes}",
                )
            gradients.append(
                torch.frombuffer(payload, dtype=dtype, offset=at, count=nbytes // itemsize)
                if nbytes
                else torch.empty(0, dtype=dtype)
            )
            at += nbytes
        if at != payload.nbytes:
            raise _corrupt(
                path,
                offset,
                f"is not an update: its buffers hold {at} of its {payload.nbytes} bytes",
            )
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
        raise _corrupt(path, offset, f"is not an update: {exc}") from exc


class UpdateLog:
    """The segments of one shard (``stem``, :func:`shard_file_stem`) in ``directory``: the
    writer of the current one, and the finder of the one a checkpoint's document starts."""

    def __init__(self, directory: str | os.PathLike[str], stem: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stem = stem
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
        self._format = XXH3_FORMAT
        self._open(self.directory / f"{self.stem}.{seq:08d}{SUFFIX}", truncate_at=None)
        self._write(encode_record({"kind": "base", **base.__dict__}, (), self._format))
        for _, path in existing[:-1]:
            path.unlink(missing_ok=True)

    def continue_after(self, segment: Segment) -> None:
        """Append to ``segment`` (the last one replayed) from its last good record (a torn
        tail or a corrupt record cut off), and delete the segments newer than it (not
        replayed: after a corrupt record, a history the shard has left)."""
        for _, path in self.segments():
            if path.name > segment.path.name:
                path.unlink(missing_ok=True)
        self._format = segment.format  # appended in the format it started in
        self._open(segment.path, truncate_at=segment.valid_bytes)

    def find(self, crc: int) -> list[Segment]:
        """The segments to replay onto the shard document with CRC-32 ``crc``: the newest
        segment whose base it is, then each segment after it (a segment starts exactly where
        the one before it ends: at a ``save``, between two updates), so that a restore of the
        checkpoint before the newest (the newest never written: its writer died) still comes
        back at the last update. Empty: no segment of that document (deleted, or never
        written). The chain stops at a segment that does not open."""
        segments = self.segments()
        for index in range(len(segments) - 1, -1, -1):
            first = self._open_segment(segments[index][1])
            if first is None or first.base.document_crc != crc:
                continue
            chain = [first]
            for _, path in segments[index + 1 :]:
                following = self._open_segment(path)
                if following is None:
                    break
                chain.append(following)
            return chain
        return []

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
        self._write(encode_record(header, buffers, self._format))
        self.appended += 1

    def close(self) -> None:
        """Close the current segment (it stays on disk), giving back the space allocated past
        its records (a truncation to its own size frees it)."""
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

    def _open(self, path: Path, truncate_at: int | None) -> None:
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
        self.space_ahead = SpaceAhead(self._fd, path, self._end)

    def _write(self, pieces: list) -> None:
        """Write every piece, in order, in as few calls as the kernel allows."""
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
