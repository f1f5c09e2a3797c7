"""Request/reply over ZeroMQ: what both ends share. The server end is
:class:`~tensorfleet.wire.service_socket.ServiceSocket` (serves many peers), the client end
:class:`~tensorfleet.wire.channel.Channel` (one client to one service).

Every request has an id and a deadline, every reply names the request it answers, and
every message is authenticated (see :mod:`tensorfleet.wire.message`). A service never
crashes on bad input: it drops and counts what it cannot accept, and tells a peer that
cannot authenticate (once) so that the peer fails with a clear error instead of a timeout.

Between tasks on one host, payloads travel through shared memory instead (chosen
automatically, see :mod:`tensorfleet.wire.shared_memory`); the messages stay the same.

Why ROUTER/DEALER: the service can hold a request and answer it later (a worker waiting for
the chief to initialize the variables waits on the server, not in a polling loop), several
requests can be in flight on one channel, and ZeroMQ reconnects by itself.

This module holds what both ends use: address checks, endpoints, ZeroMQ's connection
heartbeat, and whether shared memory is wanted.
"""

from __future__ import annotations

import socket

import zmq

from tensorfleet.errors import ClusterConfigError
from tensorfleet.wire import shared_memory as shm

#: ZeroMQ's own connection heartbeat: a ping every this many ms; a connection silent for
#: ZMQ_HEARTBEAT_TIMEOUT_MS is closed and re-established (a cut link is noticed, not waited
#: on through TCP's minutes-long retransmission timeout).
ZMQ_HEARTBEAT_IVL_MS = 1000
ZMQ_HEARTBEAT_TIMEOUT_MS = 5000


def check_resolvable(address: str, what: str) -> None:
    """Raise :class:`ClusterConfigError` when the host of ``address`` does not resolve
    (ZeroMQ would otherwise retry silently forever)."""
    host, _, port = address.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        raise ClusterConfigError(
            f"cannot resolve the host of {what} at {address!r}: {exc}. Fix the address in the "
            "cluster spec (a name this machine can resolve, or an IP address)"
        ) from None


def tcp_endpoint(address: str, bind: bool = False) -> str:
    """``host:port`` as a ZeroMQ TCP endpoint. IPv6 hosts come bracketed (``[::1]:2222``)."""
    host, _, port = address.rpartition(":")
    if bind and host in ("localhost",):
        host = "127.0.0.1"
    return f"tcp://{host}:{port}"


def shared_memory_wanted(choice: bool | None) -> bool:
    """``choice``, or (None) whether the environment and the system allow shared memory."""
    return shm.enabled() if choice is None else choice and shm.enabled()


def set_connection_heartbeats(socket: zmq.Socket) -> None:
    """Let ZeroMQ ping the peer and drop a connection that stays silent (see the constants)."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, ZMQ_HEARTBEAT_TIMEOUT_MS)
