"""When the warm spares of a run start: once the run is at work, not beside its tasks at
launch (a mixin of :class:`~tensorfleet.launch.warm_spares.WarmSpares`).

Why. A spare is the worker (or ps) command started ahead of time, past its interpreter start
and ``import torch``: seconds of CPU. Started beside the tasks at launch, it competed with
them for the CPU while they started, on every run, also the many runs that never lose a task
(on a 2-core machine, every launcher run paid its spares' start at its own start). What a
spare is for, a fault during training, comes after the tasks got
to work; so the spares start then: when the first task of the run leaves the marker
:data:`~tensorfleet.task_markers.SERVING` (a ps whose shard holds its variables, a worker past
its first training step), and at the latest :data:`SPARE_START_LATEST_S` after the start (a
run whose tasks never leave that marker: a script without the training session, all-reduce
training). The spare is then warm long before any fault of a real run, and no run's start
pays for it.

Who looks. The marker is a file: the supervising loop (:meth:`ClusterSupervisor.wait`) looks
every :data:`SPARE_START_POLL_S` until the spares started, and before it handles any event
(so a task that marks and exits at once is seen first). Outside that loop (a test or drill
that calls :meth:`~tensorfleet.launch.warm_spares.WarmSpares.wait_spare_ready` before
``wait``), ``wait_spare_ready`` looks itself: whoever holds the supervision lock may start
the spares, so they are never started from two threads at once.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tensorfleet.task_markers import SERVING

if TYPE_CHECKING:
    from tensorfleet.launch.task import Task
    from tensorfleet.task_markers import TaskMarkers

#: Seconds between two looks at the run's markers while its spares wait to start.
SPARE_START_POLL_S = 0.5
#: Seconds after the start of the run at which its spares start even though no task left the
#: SERVING marker.
SPARE_START_LATEST_S = 30.0


class SpareStart:
    """Starts the run's spares once it is at work (see the module's docstring); mixed into
    ``WarmSpares``, which provides ``_fill_spares`` and the attributes below."""

    _tasks: list[Task]
    _markers: TaskMarkers
    _start_time: float
    _spares_open: dict[str, bool]

    def _init_spare_start(self) -> None:
        #: The run is at work (or the latest start passed): spares are kept from now on.
        self._spares_started = False
        #: Held by the thread that supervises (``wait``), or that starts the spares outside it.
        self._supervision = threading.RLock()

    if TYPE_CHECKING:

        def _fill_spares(self) -> None: ...

    def _spares_pending(self) -> bool:
        """Whether some job of the run keeps spares that have not started yet."""
        return not self._spares_started and any(
            self._spares_open[t.job] for t in self._tasks if t.job in self._spares_open
        )

    def _run_at_work(self, now: float) -> bool:
        """A task of the run left SERVING, or the latest start passed."""
        if now >= self._start_time + SPARE_START_LATEST_S:
            return True
        return any(self._markers.has(t.name, SERVING) for t in self._tasks)

    def _start_spares_when_at_work(self, now: float) -> None:
        """Start the spares once the run is at work (call with the supervision lock held)."""
        if self._spares_pending() and self._run_at_work(now):
            self._spares_started = True
            self._fill_spares()

    def _spare_start_deadlines(self, now: float) -> list[float]:
        """When the supervising loop looks at the markers next (none once started)."""
        if not self._spares_pending():
            return []
        return [min(now + SPARE_START_POLL_S, self._start_time + SPARE_START_LATEST_S)]

    def _start_spares_outside_supervision(self, now: float) -> None:
        """Start the spares, when due, from a thread other than the supervising one: only
        while no thread supervises (that one looks by itself)."""
        if not self._spares_pending() or not self._supervision.acquire(blocking=False):
            return
        try:
            self._start_spares_when_at_work(now)
        finally:
            self._supervision.release()
