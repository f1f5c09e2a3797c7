"""``Timeline``: where one task's time goes, step by step, as a Chrome trace.

A training step is a chain of phases (the forward pass in the caller's closure, the
backward pass, packing the gradients, pushing them to the ps shards, waiting for their
replies, unpacking the values into the model). To see which of them take the time, and
whether any overlap, each is recorded as a *span* (a name, a start, a duration, the thread)
and written as a Chrome-trace JSON file (the "Trace Event Format": a ``traceEvents`` list of
complete ``"ph": "X"`` events), which https://ui.perfetto.dev and ``chrome://tracing`` open.

The choice: spans measured with ``time.perf_counter_ns`` placed on the wall clock
(``time.time_ns`` at the timeline's start), so that the files of several tasks of one host
can be opened together (Perfetto merges files dropped at once) and line up. The
alternative, ``torch.profiler``, records every operator and costs far more than the
microseconds per span spent here; it answers another question (which kernel), not "is the
push hidden behind the backward pass".

A span that is not a stretch of one thread's work (a request in flight, from its send to
its reply, while the thread computes) goes on a *track* of its own (``track=``: a named row
under the task, written as a thread of its own with that name), because spans of one thread
must nest and such a span overlaps others.

Turned off (the default), :data:`NO_TIMELINE` records nothing and costs one method call per
span. A timeline keeps at most :data:`MAX_EVENTS` events (the oldest go first; the file
says how many were dropped), so a long run cannot exhaust memory.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from tensorfleet.errors import ConfigError

#: A timeline keeps at most this many spans (about 200 bytes each in memory).
MAX_EVENTS = 200_000
#: The thread id of a timeline's first named track (far above any real thread id).
TRACK_TID_BASE = 1_000_000_000


class Timeline:
    """Spans of one task, written as one Chrome-trace JSON file by :meth:`write`."""

    enabled = True

    def __init__(self, task: str, max_events: int = MAX_EVENTS) -> None:
        self.task = task
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._recorded = 0
        self._origin_ns = time.perf_counter_ns()
        self._wall_origin_us = time.time_ns() // 1000
        self._pid = os.getpid()
        self._tracks: dict[str, int] = {}

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Record the time spent in the ``with`` block as the event ``name`` (``args``:
        numbers or strings shown with it, e.g. the step)."""
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter_ns(), **args)

    def add(
        self, name: str, start_ns: int, end_ns: int, track: str | None = None, **args: Any
    ) -> None:
        """Record a span measured elsewhere (``time.perf_counter_ns`` values), on the
        calling thread or on the named ``track``."""
        if track is None:
            tid = threading.get_native_id()
        else:
            tid = self._tracks.setdefault(track, TRACK_TID_BASE + len(self._tracks))
        event: dict[str, Any] = {
            "name": name,
            "cat": "tensorfleet",
            "ph": "X",
            "ts": self._wall_origin_us + (start_ns - self._origin_ns) / 1000,
            "dur": max(0, end_ns - start_ns) / 1000,
            "pid": self._pid,
            "tid": tid,
        }
        if args:
            event["args"] = args
        self._events.append(event)
        self._recorded += 1

    @property
    def events(self) -> list[dict[str, Any]]:
        """The spans kept so far (oldest first)."""
        return list(self._events)

    def to_json(self) -> dict[str, Any]:
        """The trace as Chrome's Trace Event Format (a JSON object)."""
        names = {
            "name": "process_name",
            "ph": "M",
            "pid": self._pid,
            "args": {"name": self.task},
        }
        tracks = [
            {
                "name": "thread_name",
                "ph": "M",
                "pid": self._pid,
                "tid": tid,
                "args": {"name": track},
            }
            for track, tid in self._tracks.items()
        ]
        return {
            "traceEvents": [names, *tracks, *self._events],
            "displayTimeUnit": "ms",
            "otherData": {
                "task": self.task,
                "dropped_events": self._recorded - len(self._events),
            },
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace to ``path`` (atomically: a reader never sees half a file)."""
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        try:
            make_directory(target, self.task)
            partial.write_text(json.dumps(self.to_json()))
            partial.replace(target)
        except OSError as exc:
            raise ConfigError(
                f"cannot write the timeline of {self.task} to {str(target)!r}: {exc.strerror}; "
                "give --timeline / timeline= a path in a writable directory"
            ) from None
        return target


class _NoTimeline(Timeline):
    """Records nothing (the timeline is off)."""

    enabled = False

    def __init__(self) -> None:
        super().__init__("none", max_events=1)

    def span(self, name: str, **args: Any) -> AbstractContextManager[None]:  # type: ignore[override]
        return _NOTHING  # one shared no-op context: no generator built per span, per step

    def add(
        self, name: str, start_ns: int, end_ns: int, track: str | None = None, **args: Any
    ) -> None:
        return None


_NOTHING: AbstractContextManager[None] = nullcontext()

#: The timeline of a task that records none.
NO_TIMELINE: Timeline = _NoTimeline()


def task_path(path: str | os.PathLike[str], task: str) -> Path:
    """The file of ``task`` for the timeline option ``path``: the task's name before the
    suffix (``trace.json`` -> ``trace.worker-0.json``), so the tasks of one cluster, given
    the same option, write one file each."""
    given = Path(path)
    label = "".join(c if c.isalnum() or c in "-_" else "-" for c in task)
    suffix = given.suffix or ".json"
    stem = given.name[: -len(given.suffix)] if given.suffix else given.name
    return given.with_name(f"{stem}.{label}{suffix}")


def make_directory(target: Path, task: str) -> None:
    """Make the directory of the timeline file ``target`` (and the missing ones above it,
    as ``mkdir -p``), after checking that the nearest one that exists is a directory:
    ConfigError naming it when it is a file (``mkdir`` alone would say only ``File exists``
    or ``Not a directory``). A relative ``target`` is relative to the working directory."""
    for ancestor in (target.parent, *target.parent.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise ConfigError(
                    f"cannot write the timeline of {task} to {str(target)!r}: "
                    f"{str(ancestor)!r} is a file, not a directory; give --timeline / "
                    "timeline= a path under a directory (missing directories are created)"
                )
            break
    target.parent.mkdir(parents=True, exist_ok=True)


def task_timeline(path: str | os.PathLike[str] | None, task: str) -> tuple[Timeline, Path | None]:
    """The timeline of ``task`` for the option ``path`` (None: :data:`NO_TIMELINE`), and the
    file it goes to (:func:`task_path`), whose directory is checked (made, with any missing
    parents: :func:`make_directory`) now, so that a bad path fails at the start rather than
    after the training."""
    if path is None:
        return NO_TIMELINE, None
    target = task_path(path, task)
    try:
        make_directory(target, task)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the timeline of {task} to {str(target)!r}: {exc.strerror}; give "
            "--timeline / timeline= a path in a writable directory"
        ) from None
    if not os.access(target.parent, os.W_OK):
        raise ConfigError(
            f"cannot write the timeline of {task} to {str(target)!r}: the directory is not "
            "writable; give --timeline / timeline= a path in a writable directory"
        )
    return Timeline(task), target
