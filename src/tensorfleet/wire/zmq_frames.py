"""Sending and receiving one multipart ZeroMQ message with pyzmq's compiled socket calls.

Every request and every reply of tensorfleet is one multipart message, and where payloads are
small (a heartbeat, a lookup of a few hundred table rows, a model of a few kilobytes) what a
round trip costs is the CPU of the two processes per message, not the bytes. pyzmq's
``Socket.send_multipart`` and ``recv_multipart`` are Python methods around its compiled
``send`` and ``recv``: for every frame they build an ``IntFlag`` (``SNDMORE | flags``, a
Python enum operation), call the Python ``send`` that checks for a routing id and a group,
and only then the compiled call; receiving asks ``getsockopt(zmq.RCVMORE)`` through the
same layers. Measured here (``benchmarks/request_cost.py``'s machine, 2 cores): sending a
4-frame message took 24 us through ``send_multipart`` and 10 us through the compiled
``send`` with plain int flags, on each end of every round trip.

The choice: call the compiled methods of ``zmq.backend.Socket`` directly with int flags, and
nothing else changes: the same frames, the same copy and tracking rules (pyzmq copies a
frame below the socket's ``copy_threshold`` even with ``copy=False``), and, as
``send_multipart`` does, every part's type checked before the first part leaves (a part
that is not a buffer half way through would leave a half-sent message on the socket). The
alternative, batching several messages per send, does not apply: a request is answered
before the next one of its step is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
from zmq.backend import Socket as _CompiledSocket

from tensorfleet.errors import UsageError

#: The flags as plain ints (``zmq.SNDMORE | flags`` on the enums costs an enum operation).
NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

_send = _CompiledSocket.send
_recv = _CompiledSocket.recv
_get = _CompiledSocket.get


def send_frames(
    socket: zmq.Socket,
    frames: Sequence[Any],
    flags: int = 0,
    copy: bool = False,
    track: bool = False,
) -> zmq.MessageTracker | None:
    """Send ``frames`` as one multipart message, as ``socket.send_multipart(frames, flags,
    copy, track)`` does: raises ``zmq.Again`` (``NOBLOCK``, or a send timeout) before any
    part has left; returns the last part's tracker (ZeroMQ releases the parts of a message
    in order), None when nothing is tracked."""
    for index, frame in enumerate(frames):
        if not isinstance(frame, (bytes, memoryview, zmq.Frame)):
            try:
                memoryview(frame)
            except TypeError:
                raise UsageError(
                    f"frame {index} of a message is a {type(frame).__name__}, which is not a "
                    "buffer: pass bytes, a memoryview or an object with the buffer protocol"
                ) from None
    more = flags | _SNDMORE
    last = len(frames) - 1
    for index in range(last):
        _send(socket, frames[index], more, copy, track)
    return _send(socket, frames[last], flags, copy, track)


def readable(socket: zmq.Socket) -> bool:
    """Whether a message is waiting on ``socket`` now (its ``ZMQ_EVENTS``), without waiting:
    ``socket.poll(0)`` says the same but builds a ``zmq.Poller`` at every call."""
    return bool(_get(socket, _EVENTS) & _POLLIN)


def receive_frames(socket: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """The parts of the next multipart message, not copied (``Frame.buffer`` is a read-only
    view of each), as ``socket.recv_multipart(flags, copy=False)``. Raises ``zmq.Again``
    with ``NOBLOCK`` when no message is waiting."""
    parts = [_recv(socket, flags, False)]
    while _get(socket, _RCVMORE):
        parts.append(_recv(socket, flags, False))
    return parts
