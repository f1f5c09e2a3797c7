"""Silence counted only over time the observer itself ran: one rule for a worker watching its
parameter servers (``worker/heartbeat.py``) and a ps watching its workers
(``ps/worker_roster.py``).

The rule: a peer is silent for the time since it was last heard, but never counting time
during which the observer could not have heard it. When the observer's own loop has not run
for ``stall_s`` (its process was SIGSTOPped, its VM frozen, or one long piece of work held
the loop), the peers' messages of that time wait unread in its sockets; so after such a gap
silence counts from the moment the observer ran again, and while the gap lasts
(:meth:`SilenceClock.stalled`) no peer is blamed.

Invariant: :meth:`SilenceClock.silent_for` never exceeds the time since the observer last
resumed from a stall.

Measured reason, in the 10-minute fault storms of ``benchmarks/chaos.py``: a worker SIGCONTed
after a 15 s SIGSTOP gave up its push at once as "ps:0 has not answered a heartbeat for
16 s" while the ps had run all along; a ps stopped for the liveness timeout would, on
SIGCONT, declare lost every worker whose queued heartbeat it had not read yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SilenceClock:
    """When the observer last ran, and when it last resumed after a stall of ``stall_s``."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self._clock = clock
        self.last_ran: float | None = None
        """When :meth:`ran` was last called (``clock`` seconds); None before the first."""
        self.resumed_at = float("-inf")
        """When the observer ran after a gap of ``stall_s`` or more: silence counts from then."""

    def ran(self) -> float:
        """Note that the observer runs now (after a gap of ``stall_s`` or more, silence
        counts from now); returns now."""
        now = self._clock()
        if self.last_ran is not None and now - self.last_ran >= self.stall_s:
            self.resumed_at = now
        self.last_ran = now
        return now

    def stalled(self) -> bool:
        """Whether the observer has not run for ``stall_s`` (the silence is its own)."""
        return self.last_ran is not None and self._clock() - self.last_ran >= self.stall_s

    def silent_for(self, heard: float, now: float | None = None) -> float:
        """Seconds a peer last heard at ``heard`` has been silent, counted only over time the
        observer ran."""
        now = self._clock() if now is None else now
        return now - max(heard, self.resumed_at)
