"""Rate-limited log lines about the messages a service drops and the connections it
ignores: what each kind of rejection means and its fix, at most one line per kind per
interval, each saying how many went unlogged (split out of
:mod:`tensorfleet.wire.service_socket`, which counts the rejections and calls this)."""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable

import zmq

#: Invalid messages after which a connection is ignored (quarantined) for good.
QUARANTINE_AFTER_INVALID = 8
#: Shortest time between two log lines about one kind of rejection (each kind has its own).
REJECTION_LOG_INTERVAL_S = 60.0

log = logging.getLogger("tensorfleet.security")

#: What each logged kind of rejected message means, and the fix (``rejected`` reasons; stale
#: and unknown-connection requests follow every ps restart, so they are counted only).
_REJECTION_MEANINGS = {
    "auth": "it failed authentication (the sender does not hold this cluster's secret, or the "
    "message was altered or replayed); if it is one of your tasks, give every task the same "
    "secret ($TENSORFLEET_SECRET, $TENSORFLEET_SECRET_FILE or --secret-file)",
    "replayed": "its counter is not above the last one accepted from its session: a request "
    "its client gave up on, read after newer ones (this service was stopped or stalled, and the "
    "client reconnected meanwhile), or a replay of captured traffic; nothing to do unless it "
    "recurs while every task runs normally",
    "malformed": "it is not a well-formed tensorfleet message (junk, a port scanner, or another "
    "program pointed at this port)",
    "protocol": "it speaks another tensorfleet wire protocol; run the same tensorfleet version "
    "on every task",
    "unencrypted": "its encryption does not match this service's (--encrypt / "
    "$TENSORFLEET_ENCRYPT); the sender was told so; every task must agree",
}
_ADDRESS = re.compile(r"[0-9A-Za-z.:%\[\]-]{1,64}")


class RejectionLog:
    """Rate-limited WARNING lines about messages a service drops and connections it quarantines.

    Counting alone (:attr:`ServiceSocket.rejected`) left a ps silent while junk or a worker
    with the wrong secret knocked; logging every message would let a flood fill the disk. So
    each kind (a ``rejected`` reason, or ``"quarantine"``) logs at once the first time, then
    at most once per ``interval_s``, and each line says how many were not logged since.
    """

    def __init__(
        self,
        service: str,
        interval_s: float = REJECTION_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.service = service
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._unlogged: Counter[str] = Counter()

    def due(self, kind: str) -> bool:
        """Whether a line about ``kind`` may be logged now; when not, the event is counted as
        not logged (the next line says so)."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._unlogged[kind] += 1
            return False
        self._last[kind] = now
        return True

    def rejected(self, reason: str, peer_address: str, total: int) -> None:
        """Log that a message from ``peer_address`` was dropped for ``reason`` (call when
        :meth:`due`); ``total`` is how many were dropped for it so far."""
        log.warning(
            "tensorfleet service %s: dropped a message from %s: %s (%d dropped as %r so far%s)",
            self.service,
            peer_address,
            _REJECTION_MEANINGS[reason],
            total,
            reason,
            self._since(reason),
        )

    def quarantined(self, peer_address: str, connections: int) -> None:
        """Log that the connection from ``peer_address`` is ignored from now on (call when
        :meth:`due`); ``connections`` is how many were quarantined so far."""
        log.warning(
            "tensorfleet service %s: ignoring the connection from %s for good after %d invalid "
            "messages; its further messages are dropped unread (counted as 'quarantined') "
            "(%d connection(s) quarantined so far%s)",
            self.service,
            peer_address,
            QUARANTINE_AFTER_INVALID,
            connections,
            self._since("quarantine"),
        )

    def _since(self, kind: str) -> str:
        unlogged = self._unlogged.pop(kind, 0)
        if not unlogged:
            return ""
        every = f"{self.interval_s:g} s"
        return f", {unlogged} not logged since the last such line: at most one per {every}"


def peer_address(frame: zmq.Frame | None) -> str:
    """The IP address of the peer that sent ``frame`` (ZeroMQ's ``Peer-Address``), checked
    to be only address characters, or ``"an unknown address"``."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return "an unknown address"
    if isinstance(address, str) and _ADDRESS.fullmatch(address):
        return address
    return "an unknown address"
