"""TCP ports on this machine for the tasks of a local cluster, the ps's held for the run.

A port is found by binding ``host:0`` (the kernel picks an unused one). Closing that socket
and handing the number to a task leaves a window between the close and the task's bind in
which another process can take the port: an outgoing connection's ephemeral port, or another
program's ``bind(0)``. On a machine opening many connections that happened (the test suite's
two processes, 2026-11-29: a ps failed at its bind with "Address already in use"), and the
same window opens again every time a task is restarted in place on its address.

:class:`PortReservation` closes the window instead of retrying around it: the launcher keeps
one socket bound to each port of a ps task that runs its own server, with ``SO_REUSEADDR``
and never listening, until the run ends. On Linux such a socket lets another socket bind the
same address only if that one sets ``SO_REUSEADDR`` too and nothing listens there yet:
ZeroMQ's listeners set it, so the ps binds its port as if it were free, and its restarts (a
spare taking over) bind it again; the kernel's choice of a port for ``bind(0)`` or for an
outgoing connection skips a port that has a bound socket, and a program that binds the port
by number without the option is refused. The alternative, choosing fresh ports and starting
the cluster again when a task failed at its bind, would restart tasks that had already
started, and could not help a task restarted in place later in the run (its address is in
every other task's cluster spec).

The hold is only for a program known to bind with ``SO_REUSEADDR``, tensorfleet's own server.
A program of the user's (a worker script, a ``--ps-command``) may bind its port with a plain
socket, which a held port would refuse: its port is only free when chosen, as
:func:`free_ports` gives it. (In ``ps`` modes the workers listen on nothing.)
"""

from __future__ import annotations

import socket
from collections.abc import Collection

from tensorfleet.errors import ConfigError

#: Local clusters bind loopback only (docs/architecture.md, "Choices and why").
LOOPBACK = "127.0.0.1"


def _bound_sockets(count: int, host: str, reuse_address: bool) -> list[socket.socket]:
    """``count`` sockets bound to distinct ports of ``host`` that the kernel chose, none
    listening; closed again if one cannot be bound."""
    if count < 0:
        raise ConfigError(f"count of ports must be >= 0, got {count}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            if reuse_address:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class PortReservation:
    """``count`` distinct ports of ``host``, each held by a bound socket (``SO_REUSEADDR``,
    not listening) until :meth:`release`: a task binds its port with ``SO_REUSEADDR`` as if it
    were free (ZeroMQ does), no one else is handed it meanwhile.

    Raises ``ConfigError`` for a negative count and ``OSError`` when ``host`` is not an
    address of this machine. Also a context manager that releases on exit."""

    def __init__(self, count: int, host: str = LOOPBACK):
        self.host = host
        self._sockets = _bound_sockets(count, host, reuse_address=True)
        #: The ports held, in the order asked for.
        self.ports: list[int] = [sock.getsockname()[1] for sock in self._sockets]

    @property
    def held(self) -> list[int]:
        """The ports still held, in order."""
        return [sock.getsockname()[1] for sock in self._sockets]

    def release(self, ports: Collection[int] | None = None) -> None:
        """Close the sockets holding ``ports`` (None: all): those ports are free for anyone
        again. Idempotent; what listens on a port meanwhile keeps listening."""
        kept = []
        for sock in self._sockets:
            if ports is None or sock.getsockname()[1] in ports:
                sock.close()
            else:
                kept.append(sock)
        self._sockets = kept

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Return ``count`` distinct TCP ports that are free on ``host`` right now, not held: a
    caller that binds them later has the window the module docstring describes (a local
    cluster holds its ports with :class:`PortReservation` instead).

    Raises ``ConfigError`` for a negative count and ``OSError`` when ``host`` is not an
    address of this machine.
    """
    sockets = _bound_sockets(count, host, reuse_address=False)
    try:
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = LOOPBACK) -> int:
    """Return one TCP port that is free on ``host`` right now (not held: see
    :func:`free_ports`)."""
    return free_ports(1, host)[0]
