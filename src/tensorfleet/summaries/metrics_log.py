"""Metrics as JSON lines: a plain-text record of training that needs no TensorBoard to read.

Each line is one JSON object::

    {"step": 1200, "wall_time": 1718000000.5, "loss": 0.31, "accuracy": 0.91}

``step`` is the global step, ``wall_time`` seconds since the epoch, every other key a tag.
JSON has no NaN or infinity, so a non-finite value is written as ``null`` and read back as
``None``. Every record is flushed to the operating system as it is written (a crashed
process loses nothing already written) and synced to disk on close.

A run killed while writing a line leaves a partial last line: :func:`read_metrics` skips it
with a warning, and a :class:`MetricsLog` reopened on the file (a resumed run) removes it
before appending. A damaged line anywhere else is an error that names the file and the line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from tensorfleet.errors import ConfigError
from tensorfleet.summaries.event_file import check_scalars, close_durably

logger = logging.getLogger(__name__)

#: Keys of every record; not usable as tags.
RESERVED_KEYS = frozenset({"step", "wall_time"})


def _parse_record(line: bytes) -> dict[str, Any]:
    """One line as a record, or ``ValueError`` saying what is wrong with it."""
    record = json.loads(line)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not isinstance(record, dict):
        raise ConfigError(f"expected a JSON object, got {type(record).__name__}")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ConfigError(f'expected an integer "step", got {step!r}')
    return record


class MetricsLog:
    """Appends metrics records to the JSON-lines file ``path`` (created if missing; its
    directory must exist).

    ::

        with MetricsLog("runs/a/metrics.jsonl") as log:
            log.write(100, {"loss": 0.31})
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.exists():
            _drop_partial_last_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # closed by close()

    def write(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        """Append one record: ``values`` (tag -> number) at ``step``, stamped ``wall_time``
        (default: now). Non-finite values are written as ``null``."""
        step, checked = check_scalars(step, values)
        clash = RESERVED_KEYS & checked.keys()
        if clash:
            raise ConfigError(
                f"tag(s) {sorted(clash)} are reserved in metrics records; rename them "
                "(e.g. 'train/step')"
            )
        if self._file.closed:
            raise ConfigError(f"metrics log {self.path} is closed")
        record: dict[str, Any] = {
            "step": step,
            "wall_time": time.time() if wall_time is None else float(wall_time),
        }
        record.update({tag: v if math.isfinite(v) else None for tag, v in checked.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Flush, sync to disk and close the file; closing twice is harmless."""
        close_durably(self._file)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of the metrics file ``path``, in file order.

    Non-finite values come back as ``None``. A partial last line (a run killed while writing
    it) is skipped with a logged warning; a damaged line elsewhere raises ``ValueError``
    naming the file and the line number.
    """
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(_parse_record(line))
        except ValueError as exc:
            if number == len(lines):  # no newline after it: the write was cut short
                logger.warning(
                    "%s: ignoring the partial last line %d (was the run killed while writing "
                    "it?): %.60r",
                    path,
                    number,
                    line,
                )
                break
            raise ConfigError(
                f"{path}, line {number}: not a metrics record ({exc}); the file is damaged: "
                "fix or delete that line"
            ) from exc
    return records


def _drop_partial_last_line(path: Path) -> None:
    """If ``path`` ends in a line without its newline, end that line if it is a whole record,
    else cut it off (with a warning), so that appending starts on a fresh line."""
    with open(path, "rb+") as file:
        size = file.seek(0, os.SEEK_END)
        if size == 0:
            return
        file.seek(size - 1)
        if file.read(1) == b"\n":
            return
        start = size
        while start > 0:  # find the start of the last line, reading backwards
            block_start = max(0, start - 4096)
            file.seek(block_start)
            newline = file.read(start - block_start).rfind(b"\n")
            if newline >= 0:
                start = block_start + newline + 1
                break
            start = block_start
        file.seek(start)
        tail = file.read()
        try:
            _parse_record(tail)
        except ValueError:
            logger.warning(
                "%s: removing the partial last line (was the run killed while writing it?): %.60r",
                path,
                tail,
            )
            file.truncate(start)
        else:
            file.seek(size)
            file.write(b"\n")
