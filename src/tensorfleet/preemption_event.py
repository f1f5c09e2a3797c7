"""The process's preemption event: set when this task was preempted (its first SIGTERM, see
:mod:`tensorfleet.session.preemption`), read by the waits that must not outlast it.

Why a process-wide event: a signal is delivered to the process, not to an object, and the
wait that must notice it can sit layers below the session that handles the signal (the
client's recovery loop retries for minutes while the parameter servers are unreachable; a
preempted worker there has nothing left to save and should exit within the cluster
manager's grace period instead of being killed). The session sets the event while its
handler is installed and clears it when the handler is removed, so one process running
several sessions in turn (tests, notebooks) starts each with it clear.
"""

from __future__ import annotations

import logging
import threading
import time

from tensorfleet.errors import Preempted

log = logging.getLogger("tensorfleet.worker")

_PREEMPTED = threading.Event()
_PREEMPTED_AT: list[float] = []  # time.monotonic() of the preemption, while it is recorded


def mark_preempted() -> None:
    """Record that this task was preempted (called by the SIGTERM handler), and when."""
    if not _PREEMPTED.is_set():
        _PREEMPTED_AT[:] = [time.monotonic()]
    _PREEMPTED.set()


def clear_preempted() -> None:
    """Forget a preemption (the handler that recorded it was removed)."""
    _PREEMPTED.clear()
    _PREEMPTED_AT.clear()


def preempted() -> bool:
    """Whether this task was preempted."""
    return _PREEMPTED.is_set()


def seconds_since_preempted() -> float | None:
    """Seconds since this task was preempted, or None when it was not."""
    if not _PREEMPTED.is_set() or not _PREEMPTED_AT:
        return None
    return time.monotonic() - _PREEMPTED_AT[0]


def wait_unless_preempted(seconds: float) -> bool:
    """Sleep ``seconds``, waking at once on a preemption; True when preempted."""
    return _PREEMPTED.wait(max(0.0, seconds))


def raise_if_preempted(waiting_for: str) -> None:
    """:class:`~tensorfleet.errors.Preempted` if this task was preempted: for a wait with
    nothing to save behind it (a worker still saying hello to its parameter servers), which
    would otherwise sit out its deadline past the cluster manager's grace period."""
    if _PREEMPTED.is_set():
        message = (
            f"preempted (SIGTERM) while waiting for {waiting_for}: nothing to save yet; "
            "exiting with status 143, a preemption to a launcher or cluster manager that "
            "restarts tasks"
        )
        log.warning("%s", message)  # a SystemExit prints nothing of its own
        raise Preempted(message)
