"""Requests whose payload is still arriving on their client's payload stream, held in order.

Rule. A request whose verified header says its payload follows on the payload stream
(:mod:`tensorfleet.wire.payload_collector`) is held until that payload is done; every later
message of the same client session is held behind it, undecoded. Messages of other sessions
are served meanwhile.

Invariant: a session's messages are served in the order they were sent. A push held while
the pull its client sent after it ran first would answer that pull with values from before
the push; ZeroMQ keeps a connection's order, and so does the service with the stream.
Only the first message of a session's queue can wait for a payload (the ones behind it are
not decoded yet), so a held message leaves when its one payload is done: read, failed, or
late (the collector reads it with the request's deadline), never later.

The collectors' threads wake the service's poll through a pipe (:meth:`HeldRequests.fileno`,
which a ZeroMQ poller watches beside the socket): a request whose payload completed is
served within the poll's wake-up, not at the loop's next tick.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensorfleet.wire.auth import Buffer
from tensorfleet.wire.payload_collector import PendingPayload

#: Messages a session may have held behind a payload still arriving; more are dropped
#: (counted by the service as ``held_overflow``): a client has a few requests in flight.
MAX_HELD_PER_SESSION = 1024


@dataclass
class HeldMessage:
    """A message taken from the service's socket and not served yet."""

    peer: bytes
    """The ZeroMQ address of its connection."""
    frames: Sequence[Buffer]
    """Its frames (envelope first), decoded again when it leaves."""
    payload: PendingPayload | None
    """The payload it waits for (only the first of a session's queue has one)."""
    origin: Any = None
    """The ZeroMQ frame it came with (where the peer's address is, for the log lines of a
    rejection)."""


class HeldRequests:
    """The held messages of every session, and the pipe that wakes the service's poll."""

    def __init__(self) -> None:
        self._queues: dict[bytes, deque[HeldMessage]] = {}
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        # Held by a wake and by close: a wake never writes to a descriptor closed (and reused).
        self._pipe_lock = threading.Lock()
        self._closed = False
        self._woken = False
        """Set by :meth:`wake` after it wrote to the pipe, cleared by :meth:`_drain` before
        it reads: a drain with nothing written since the last one reads nothing and makes no
        system call (every request of the service's loop asks for one)."""

    def fileno(self) -> int:
        """The descriptor a poller watches: readable after :meth:`wake`."""
        return self._wake_read

    def wake(self) -> None:
        """Wake the service's poll (from a collector's thread)."""
        with self._pipe_lock:
            if self._closed:
                return
            try:
                os.write(self._wake_write, b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already: the poll wakes anyway
            # After the write: a drain that sees the flag finds the byte (set before it, a
            # drain between the two would clear the flag and miss the byte, leaving the pipe
            # readable with no drain to come, and the service's poll spinning).
            self._woken = True

    def holds(self, session_id: bytes) -> bool:
        """Whether messages of ``session_id`` are held (a new one must queue behind them)."""
        return session_id in self._queues

    def hold(self, session_id: bytes, message: HeldMessage) -> bool:
        """Hold ``message``: first in its session's queue when it waits for a payload (only
        the first can: see the module), else last. False when the queue is full (the
        message is not held)."""
        held = self._queues.setdefault(session_id, deque())
        if message.payload is not None:
            held.appendleft(message)
            return True
        if len(held) >= MAX_HELD_PER_SESSION:
            return False
        held.append(message)
        return True

    def ready(self) -> bool:
        """Whether :meth:`next_ready` has a message to give."""
        return any(self._leaves(held[0]) for held in self._queues.values())

    def next_ready(self) -> tuple[bytes, HeldMessage] | None:
        """The first message of a session whose payload is done, or that waits for none (it
        was behind one that left), with its session; it is no longer held."""
        self._drain()
        for session_id, held in self._queues.items():
            if self._leaves(held[0]):
                message = held.popleft()
                if not held:
                    del self._queues[session_id]
                return session_id, message
        return None

    @staticmethod
    def _leaves(message: HeldMessage) -> bool:
        return message.payload is None or message.payload.done

    def _drain(self) -> None:
        if self._closed or not self._woken:
            return
        self._woken = False  # before the read: a wake from now on is drained next time
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass  # empty

    def __len__(self) -> int:
        return sum(len(held) for held in self._queues.values())

    def close(self) -> None:
        self._queues.clear()
        with self._pipe_lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)
