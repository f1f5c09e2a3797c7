"""A SIGTERM from outside is a preemption, not the end of the job.

Cluster managers reclaim machines with SIGTERM and a grace period before SIGKILL (Kubernetes:
``terminationGracePeriodSeconds``, 30 s by default; Slurm: ``KillWait``, 30 s; spot
instances: a notice of 30-120 s). Python's default for SIGTERM ends the process at once,
losing everything since the newest checkpoint. Here a task that gets SIGTERM saves what it
can and then exits with status 143 (128 + SIGTERM), which the launcher (by its restart
policy) and cluster managers treat as a kill by a signal, so the task is restarted and the
run goes on. A task cannot tell who sent the signal: the same SIGTERM comes from the launcher
stopping the cluster after an error, or from a user's ``kill``, and then nothing restarts it;
so the log lines of a ps say what status 143 means to whoever restarts tasks, not that a
restart will come:

* a **worker** finishes the step it is in (its push is applied, nothing is half sent); the
  **chief** then writes a checkpoint (in ``allreduce`` mode a collective one, at the next
  ``should_stop()``, with every worker, and every worker leaves after it: the group restarts
  together); the worker tells the ps shards it *left* (it counts as
  lost at once: sync steps stop waiting for it, and its restarted process takes over its
  identity at once), leaves the marker ``task_markers.LEFT`` for a launcher that supervises it
  (the launcher then hands its identity to the restart, a warm spare, without waiting for this
  interpreter's teardown: :mod:`tensorfleet.launch.preempted_handover`), and
  :class:`~tensorfleet.errors.Preempted` ends the process;
* a **ps** asks the chief for a checkpoint and keeps serving until it is written (or the grace
  period ``preempt_grace_s`` passes), then exits (:mod:`tensorfleet.ps.preemption_drain`).

When the whole job is preempted (every task gets SIGTERM, as when the launcher itself is
stopped or Slurm preempts the job), the ps tasks wait for the chief's checkpoint and the chief
writes it: the next run resumes at the step of the preemption.

A worker preempted while its client is recovering (the parameter servers unreachable) has
nothing to save: the recovery gives up at once (:mod:`tensorfleet.preemption_event`) and the
worker exits with status 143 as well, instead of retrying past the grace period.

A second SIGTERM while the first is being handled ends the process at once (the default
action), for the impatient and for the cases where saving hangs.

Child processes die of the same SIGTERM when it is sent to the whole process group (Slurm,
torchrun and ``tensorfleet launch`` signal a task's group): a ``DataLoader``'s workers end
at once (torch makes them exit on a SIGTERM from anyone but their parent), and torch's
SIGCHLD handler in the training process raises ``RuntimeError: DataLoader worker ... is
killed by signal: Terminated`` wherever the main thread is, e.g. inside the step whose push
is in flight. After the notice that handler's errors are logged during a step and raised at
its end, once its exchange is complete, and raised at once outside a step (the loop waiting
for its next batch) (:func:`keep_child_deaths_out_of_the_step`), but never once the session
is leaving (its exit, a preempted worker's leave, and after: a raise there cut the chief's
checkpoint short); the session takes an error
that ends its ``with`` block after the notice for the preemption it follows (the chief's
checkpoint, status 143), not for a failure that ends training.

The handler is only installed from the main thread (Python delivers signals there); a
session or server driven from another thread keeps the process's own SIGTERM handling.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from tensorfleet.preemption_event import clear_preempted, mark_preempted

log = logging.getLogger("tensorfleet.session")


class PreemptionNotice:
    """While entered (``with``), SIGTERM calls ``on_notice`` instead of ending the process;
    a second SIGTERM ends it with the default action. The previous handler is restored on
    exit. Outside the main thread it installs nothing (:attr:`installed` False)."""

    def __init__(
        self,
        on_notice: Callable[[], None] | None = None,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        self.received = threading.Event()
        """Set by the first SIGTERM."""
        self.busy = busy
        """Whether the session is inside a step (or its should_stop()) now: a child's death
        is raised at once outside, logged and kept for the step's end inside."""
        self.deferred: list[Exception] = []
        """Errors of the SIGCHLD handler logged during a step since the notice."""
        self._on_notice = on_notice
        self._leaving = False
        """The session is ending (its exit, a preempted worker's leave): a child's death is
        logged from then on, never raised into that work."""
        self._previous: Any = None
        self._previous_sigchld: Any = None
        self.installed = False

    def __enter__(self) -> PreemptionNotice:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self.installed = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self._previous)
            if self._previous_sigchld is not None and not self.received.is_set():
                signal.signal(signal.SIGCHLD, self._previous_sigchld)
                self._previous_sigchld = None
            # After a notice the wrapper stays: the process is on its way out (Preempted),
            # and a loader's last workers may die while it writes its marker or tears down.
            self._leaving = True
            self.installed = False
            clear_preempted()

    def leaving(self) -> None:
        """The session is ending: from now on a child's death after the notice is logged,
        not raised (a raise would cut short the checkpoint and the exit of a preemption)."""
        self._leaving = True

    def _inside(self) -> bool:
        """Whether a child's death is to be logged (and kept) rather than raised now."""
        return self._leaving or self.busy is None or self.busy()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received.is_set():  # the second one: end now, as SIGTERM does by default
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.received.set()
        mark_preempted()  # the waits below the session stop waiting (the client's recovery)
        self._previous_sigchld = keep_child_deaths_out_of_the_step(self._inside, self.deferred)
        if self._on_notice is not None:
            self._on_notice()


def keep_child_deaths_out_of_the_step(busy: Callable[[], bool], deferred: list[Exception]) -> Any:
    """Wrap the process's SIGCHLD handler, when it is a Python one (torch's ``DataLoader``
    installs one that raises when a worker dies), so that its errors are not raised inside a
    step (``busy()`` true): there they are logged and kept in
    ``deferred`` for the step's end; outside, as in the loop's wait for its next batch, they
    are raised at once, as before (a DataLoader would notice its dead workers only at its
    next poll, 5 s later: a ps waiting for the chief's checkpoint may have given up by
    then). Returns the handler it wrapped (None: none was), for :class:`PreemptionNotice`
    to put back."""
    previous = signal.getsignal(signal.SIGCHLD)
    if not callable(previous):
        return None

    def logged(signum: int, frame: FrameType | None) -> None:
        if not busy():
            previous(signum, frame)
            return
        try:
            previous(signum, frame)
        except Exception as exc:  # noqa: BLE001 - logged, kept, raised at the step's end
            log.warning(
                "after the SIGTERM: %s (a child process ended by the same signal); the step "
                "in progress completes first",
                exc,
            )
            deferred.append(exc)

    signal.signal(signal.SIGCHLD, logged)
    return previous
