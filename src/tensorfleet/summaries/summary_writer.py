"""One writer for a run's scalars, in two formats at once.

``SummaryWriter(logdir)`` writes every point both as TensorBoard events (an event file in
``logdir``, for ``tensorboard --logdir``) and as a JSON line in ``logdir/metrics.jsonl`` (for
``tensorfleet plot``, scripts and anyone without TensorBoard). A second writer on the same
``logdir`` (a resumed run) appends to ``metrics.jsonl`` and starts a new event file next to
the old ones; TensorBoard reads them all.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from tensorfleet.summaries.event_file import EventFileWriter
from tensorfleet.summaries.metrics_log import MetricsLog

#: Name of the JSON-lines file in a summary directory.
METRICS_FILE = "metrics.jsonl"


class SummaryWriter:
    """Writes scalars to TensorBoard events and ``metrics.jsonl`` in ``logdir`` (created,
    with its parents, if missing).

    ::

        with SummaryWriter("runs/cnn") as writer:
            writer.scalars(100, {"loss": 0.31, "accuracy": 0.91})
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = Path(logdir)
        if self.logdir.exists() and not self.logdir.is_dir():
            raise NotADirectoryError(
                f"summary directory {str(self.logdir)!r} is a file; give a directory"
            )
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.logdir / METRICS_FILE
        self._metrics = MetricsLog(self.metrics_path)
        try:
            self._events = EventFileWriter(self.logdir)
        except BaseException:
            self._metrics.close()
            raise

    @property
    def event_file(self) -> Path:
        """The event file this writer writes."""
        return self._events.path

    def scalars(
        self, step: int, values: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        """Record ``values`` (tag -> number) at global step ``step``, stamped ``wall_time``
        (default: now, seconds since the epoch), in both files."""
        stamp = time.time() if wall_time is None else wall_time
        self._metrics.write(step, values, stamp)  # checks everything before either write
        self._events.add_scalars(step, values, stamp)

    def close(self) -> None:
        """Sync both files to disk and close them; closing twice is harmless."""
        try:
            self._events.close()
        finally:
            self._metrics.close()

    def __enter__(self) -> SummaryWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
