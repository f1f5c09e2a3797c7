"""Where a ps shard records how long it spends on each request: receiving and verifying it,
applying an update, sending the reply.

The ps layer sits below the worker's :class:`~tensorfleet.worker.timeline.Timeline` (the
Chrome trace a task writes), so it records into anything with the same ``span`` method: a
:class:`SpanRecorder`. The task's ``Server`` hands its ``ModelRouter`` a ``Timeline`` when it
is given a timeline path (``tensorfleet server --timeline FILE``, ``ServerConfig(timeline=)``)
and writes it when the service ends; otherwise :data:`NO_SPANS` records nothing, at the cost
of one method call per span.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class SpanRecorder(Protocol):
    """Records the time spent in a ``with`` block as a span named ``name``."""

    enabled: bool

    def span(self, name: str, **args: Any) -> Any: ...


class _NoSpans:
    """Records nothing."""

    enabled = False

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        yield


#: The recorder of a ps that keeps no timeline.
NO_SPANS: SpanRecorder = _NoSpans()
