"""Free TCP ports on this machine, for the tasks of a local cluster.

A port is found by binding ``host:0`` (the kernel picks an unused one), reading it back and
closing the socket. All sockets of one call stay open until every port is chosen, so the
ports of one cluster are distinct. There is an unavoidable window between closing the socket
here and the task binding the port again, in which another process could take it; the
kernel hands out ephemeral ports in rotation, so in practice this does not happen on a
machine that is not starved of ports, and a task that cannot bind says so clearly.
"""

from __future__ import annotations

import socket

from tensorfleet.errors import ConfigError

#: Local clusters bind loopback only (docs/architecture.md, "Choices and why").
LOOPBACK = "127.0.0.1"


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Return ``count`` distinct TCP ports that are free on ``host`` right now.

    Raises ``ValueError`` for a negative count and ``OSError`` when ``host`` is not an
    address of this machine.
    """
    if count < 0:
        raise ConfigError(f"count of ports must be >= 0, got {count}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = LOOPBACK) -> int:
    """Return one TCP port that is free on ``host`` right now."""
    return free_ports(1, host)[0]
