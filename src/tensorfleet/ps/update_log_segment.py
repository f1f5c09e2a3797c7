"""An update-log segment file (:mod:`tensorfleet.ps.update_log`): its records, written and
read back, checked and never trusted.

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
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch
import xxhash

from tensorfleet.errors import CheckpointError
from tensorfleet.wire.tensors import DTYPES

log = logging.getLogger("tensorfleet.ps")

MAGIC = b"TFUPDATELOG2\n"
"""The first bytes of every segment file written now (records checked by XXH3-64)."""
MAGIC_CRC32 = b"TFUPDATELOG1\n"
"""The first bytes of a segment of the first format (records checked by CRC-32): read only."""
RECORD_TAG = b"TFUR"
HEADER_LENGTH = struct.Struct("<I")


class UpdateLogCorrupt(CheckpointError):
    """A complete record of an update log whose bytes are not what was written."""


class SegmentCutShort(UpdateLogCorrupt):
    """A segment whose first record (its checkpoint's base or a snapshot) was never written
    whole: its process died while writing it. Nothing logged after it was acknowledged (a
    segment's first record is whole before any update is logged in it, and a snapshot is
    written before the reply to the push it follows), so a restore ends with the segment
    before it and loses nothing."""


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
    """The checkpoint a segment follows: its id (:func:`checkpoint_id`, in the field named
    ``document_crc`` since the first format), version, global step."""

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
    hyperparameters: dict[str, Any] | None = None
    """The rule's hyperparameters it was applied with (None in records written before they
    were logged: the rule's own)."""


def checkpoint_id(
    shard: int,
    global_step: int,
    version: int,
    values: Mapping[str, torch.Tensor],
    ema: Mapping[str, torch.Tensor] | None,
    optimizer: Mapping[str, Mapping[str, torch.Tensor]],
) -> int:
    """What names the checkpoint a segment follows (its ``Base``): the XXH3-64 of the
    shard's dense state in it, the state a replay continues from. Not the document's bytes:
    the document a restore is given may hold the tables whole where the save answered with
    their delta (a delta checkpoint's chain, merged), or buffers and rows the log does not
    replay, around the same dense state. Computed alike from the live store at a save and
    from the decoded document at a restore."""
    pieces: list[bytes | memoryview] = [f"{shard}:{global_step}:{version}".encode()]

    def add(name: str, tensor: torch.Tensor) -> None:
        pieces.append(name.encode())
        flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
        pieces.append(memoryview(flat.numpy()))

    for name in sorted(values):
        add(f"value/{name}", values[name])
    for name in sorted(ema or {}):
        add(f"ema/{name}", (ema or {})[name])
    for name in sorted(optimizer):
        for key in sorted(optimizer[name]):
            add(f"optimizer/{name}/{key}", optimizer[name][key])
    return _xxh3_64(pieces)


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
    """One segment file, read as a stream: its first record at once (a file that does not
    start with :data:`MAGIC` and a base or snapshot record is :class:`UpdateLogCorrupt`,
    raised), then :meth:`updates` one record at a time (one record in memory at a time: a
    segment may hold gigabytes). After :meth:`updates` ends, ``valid_bytes`` is where the
    last good record ends (less than the file's size after a torn tail or a corrupt record)
    and ``error`` describes a corrupt record (None: none).

    A segment starts either at a checkpoint (a *base* record: the CRC-32 of the checkpoint's
    shard document, its version and global step) or at a *snapshot* (the shard's dense state
    itself, as a shard document without tables or buffers, in ``snapshot``; ``roots``: the
    checkpoints, by document CRC-32, whose restore may start here instead of at their own
    segment: the state here is theirs followed by every record logged since)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.error: UpdateLogCorrupt | None = None
        self.snapshot: memoryview | None = None
        with open(path, "rb") as file:
            magic = file.read(len(MAGIC))
            record_format = FORMATS.get(magic)
            if record_format is None:
                raise _corrupt(path, 0, f"is not an update log (it starts with {magic[:16]!r})")
            self.format = record_format
            first = _read_record(
                path, file, len(MAGIC), os.fstat(file.fileno()).st_size, record_format
            )
        if first is None:
            raise SegmentCutShort(
                f"update log {path}: its first record (a snapshot, or the start after a "
                "checkpoint) was cut short: the process died while writing it. Nothing logged "
                "after it was acknowledged: the replay ends with the segment before it"
            )
        kind = first[0].get("kind")
        if kind not in ("base", "snapshot"):
            raise _corrupt(path, len(MAGIC), "is not the segment's base or snapshot record")
        header, payload, self.valid_bytes = first
        try:
            if kind == "base":
                self.base = Base(
                    int(header["document_crc"]), int(header["version"]), int(header["global_step"])
                )
                self.roots: tuple[int, ...] = ()
            else:
                self.snapshot = payload
                self.roots = tuple(int(root) for root in header["roots"])
                self.base = Base(  # named by the newest checkpoint it follows
                    self.roots[0] if self.roots else 0,
                    int(header["version"]),
                    int(header["global_step"]),
                )
        except (KeyError, TypeError, ValueError) as exc:
            raise _corrupt(path, len(MAGIC), f"is not a {kind} record: {exc!r}") from exc

    def starts_for(self, crc: int) -> bool:
        """Whether a restore of the checkpoint whose document has CRC-32 ``crc`` may start
        its replay here: this is that checkpoint's segment, or a snapshot taken after it."""
        return crc in self.roots if self.snapshot is not None else self.base.document_crc == crc

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
            header.get("hyperparameters"),
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise _corrupt(path, offset, f"is not an update: {exc}") from exc
