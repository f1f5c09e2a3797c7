"""A TensorBoard event-file writer for scalars, in pure Python.

TensorBoard reads *event files*: a sequence of TFRecords, each holding one serialized
``tensorflow.Event`` protocol buffer. Writing them takes three small pieces, all here, so that
tensorfleet needs neither tensorflow, tensorboard nor protobuf to produce them:

* TFRecord framing: ``uint64 length``, ``uint32 masked_crc32c(length)``, ``data``,
  ``uint32 masked_crc32c(data)``, all little-endian;
* CRC32C (Castagnoli), table-driven;
* the few protobuf fields of ``Event`` and ``Summary`` that scalars use, encoded by hand::

      Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
                Summary summary = 5; }
      Summary { repeated Value value = 1; }
      Value   { string tag = 1; float simple_value = 2; }

Values are stored as float32 (``simple_value``), as TensorBoard does. Each record is flushed
to the operating system as soon as it is added, so a crash of the training process loses
nothing that was already added.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, BinaryIO

from tensorfleet.errors import ConfigError, ConfigTypeError

#: The first record of every event file names the format version.
FILE_VERSION = "brain.Event:2"
_FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# -- CRC32C and TFRecord framing -------------------------------------------------------------


def _crc32c_table() -> tuple[int, ...]:
    poly = 0x82F63B78  # Castagnoli polynomial, bit-reversed
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """The CRC32C (Castagnoli) checksum of ``data``, as TFRecord uses it."""
    crc = 0xFFFFFFFF
    table = _CRC32C_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC32C: rotated right by 15 bits plus a constant, so that a CRC of
    data that itself contains CRCs is not trivially related to them."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


# -- protobuf encoding -----------------------------------------------------------------------

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
    if value < 0:  # int64: two's complement on 64 bits, always ten bytes
        value += 1 << 64
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, _LENGTH_DELIMITED) + _varint(len(payload)) + payload


def encode_event(
    wall_time: float,
    step: int = 0,
    file_version: str | None = None,
    scalars: Mapping[str, float] | None = None,
) -> bytes:
    """One serialized ``Event``: a file-version record, or a summary of scalar values."""
    out = _key(1, _FIXED64) + struct.pack("<d", wall_time)
    if step:
        out += _key(2, _VARINT) + _varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if scalars is not None:
        summary = b"".join(
            _length_delimited(
                1,
                _length_delimited(1, tag.encode()) + _key(2, _FIXED32) + struct.pack("<f", value),
            )
            for tag, value in scalars.items()
        )
        out += _length_delimited(5, summary)
    return out


# -- checking what callers give ---------------------------------------------------------------


def check_scalars(step: int, values: Mapping[str, float]) -> tuple[int, dict[str, float]]:
    """``step`` as an int and ``values`` as floats, or a clear error naming what is wrong.

    Raises ``TypeError`` for a step that is not an integer or a value that is not a number,
    ``ValueError`` for an empty or non-string tag or a step outside int64.
    """
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise ConfigTypeError(f"step must be an integer (the global step), got {step!r}")
    step = step.__index__()
    if not _INT64_MIN <= step <= _INT64_MAX:
        raise ConfigError(f"step must fit in an int64, got {step}")
    if not isinstance(values, Mapping):
        raise ConfigTypeError(
            f"values must be a mapping of tag -> number, got {type(values).__name__}"
        )
    checked: dict[str, float] = {}
    for tag, value in values.items():
        if not isinstance(tag, str) or not tag:
            raise ConfigError(f"a tag must be a non-empty string, got {tag!r}")
        if isinstance(value, (str, bytes)):
            raise ConfigTypeError(f"value of {tag!r} must be a number, got the string {value!r}")
        try:
            checked[tag] = float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigTypeError(
                f"value of {tag!r} must be a number (e.g. float(loss)), got "
                f"{type(value).__name__}: {exc}"
            ) from exc
    return step, checked


def _as_float32(value: float) -> float:
    """``value`` clipped to float32's range (beyond it, float32 holds an infinity)."""
    if math.isfinite(value) and abs(value) > _FLOAT32_MAX:
        return math.copysign(math.inf, value)
    return value


# -- the writer -------------------------------------------------------------------------------


class EventFileWriter:
    """Writes scalar summaries to a new event file in ``logdir`` (which must exist).

    The file is ``events.out.tfevents.<time>.<hostname>.<pid>.tensorfleet`` (with ``.1``,
    ``.2``, ... appended if that name is taken). A directory can hold several event files,
    e.g. one per resumed run: TensorBoard reads them all, in the order of their names.

    ::

        with EventFileWriter("runs/a") as writer:
            writer.add_scalars(100, {"loss": 0.31, "accuracy": 0.91})
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = Path(logdir)
        if not self.logdir.is_dir():
            raise FileNotFoundError(
                f"event-file directory {str(self.logdir)!r} does not exist; create it first "
                "(SummaryWriter does)"
            )
        now = time.time()
        base = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.tensorfleet"
        self.path, self._file = self._create(base)
        self._write(encode_event(now, file_version=FILE_VERSION))

    def _create(self, base: str) -> tuple[Path, BinaryIO]:
        for attempt in range(1000):
            path = self.logdir / (base if attempt == 0 else f"{base}.{attempt}")
            try:
                return path, open(path, "xb")  # closed by close()
            except FileExistsError:
                continue
        raise FileExistsError(f"cannot find a free event-file name like {base!r} in {self.logdir}")

    def _write(self, event: bytes) -> None:
        if self._file.closed:
            raise ConfigError(f"event file {self.path} is closed")
        self._file.write(tfrecord(event))
        self._file.flush()

    def add_scalars(
        self, step: int, values: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        """Record ``values`` (tag -> number) at ``step``, stamped ``wall_time`` (default:
        now, in seconds since the epoch). Values beyond float32's range become infinities."""
        step, checked = check_scalars(step, values)
        stamp = time.time() if wall_time is None else float(wall_time)
        self._write(
            encode_event(stamp, step, scalars={tag: _as_float32(v) for tag, v in checked.items()})
        )

    def flush(self) -> None:
        """Push what was written to the operating system (``add_scalars`` already does)."""
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        """Flush, sync to disk and close the file; closing twice is harmless."""
        close_durably(self._file)

    def __enter__(self) -> EventFileWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def close_durably(file: IO) -> None:
    """Flush ``file``, sync it to disk and close it; closing twice is harmless. (The event
    file and the metrics log end the same way: what a run wrote survives a crash after.)"""
    if file.closed:
        return
    file.flush()
    os.fsync(file.fileno())
    file.close()
