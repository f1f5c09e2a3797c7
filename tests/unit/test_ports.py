"""Ports for the tasks of a local cluster: chosen free, and held for the run."""

from __future__ import annotations

import errno
import socket

import pytest
import zmq

from tensorfleet.launch.backends.local import LocalBackend
from tensorfleet.launch.ports import LOOPBACK, PortReservation, free_port, free_ports


def test_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(0 < port < 65536 for port in ports)
    # Closed again: every task can bind its port right away.
    sockets = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((LOOPBACK, port))
    finally:
        for sock in sockets:
            sock.close()


def test_single_port() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind((LOOPBACK, port))


def test_zero_and_negative_counts() -> None:
    assert free_ports(0) == []
    with pytest.raises(ValueError, match="count of ports"):
        free_ports(-1)
    with pytest.raises(ValueError, match="count of ports"):
        PortReservation(-1)


def test_foreign_address_is_an_error() -> None:
    with pytest.raises(OSError):
        free_ports(1, "192.0.2.1")  # TEST-NET-1: never an address of this machine
    with pytest.raises(OSError):
        PortReservation(1, "192.0.2.1")


def _plain_bind_error(port: int) -> int | None:
    """The errno of binding ``port`` without SO_REUSEADDR (a program that picked that number),
    None when it could."""
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError as exc:
            return exc.errno
    return None


def test_a_held_port_is_refused_to_others_until_released() -> None:
    with PortReservation(4) as reservation:
        assert len(set(reservation.ports)) == 4 and reservation.held == reservation.ports
        assert all(_plain_bind_error(port) == errno.EADDRINUSE for port in reservation.ports)
        first, *others = reservation.ports
        reservation.release([first])  # one port given back, the others still held
        assert reservation.held == others
        assert _plain_bind_error(first) is None
        assert all(_plain_bind_error(port) == errno.EADDRINUSE for port in others)
    assert reservation.held == []
    assert all(_plain_bind_error(port) is None for port in reservation.ports)


def test_the_kernel_never_hands_out_a_held_port() -> None:
    """The window the reservation closes: another process's ``bind(0)`` (and an outgoing
    connection's ephemeral port, chosen by the same rule) taking a task's port. Closed sockets'
    ports come back within this many binds (each of 16 ports has a chance in about 28,000 per
    bind: they would come back about 11 times); held ones never do."""
    with PortReservation(16) as reservation:
        held = set(reservation.ports)
        handed_out = set()
        for _ in range(20_000):
            with socket.socket() as sock:
                sock.bind((LOOPBACK, 0))
                handed_out.add(sock.getsockname()[1])
        assert not handed_out & held


def test_a_zeromq_service_listens_on_a_held_port_and_again_after_it_closed() -> None:
    """A ps binds its port as ZeroMQ does (SO_REUSEADDR), also when restarted in place (each
    round its own context, terminated as a process's would be at its exit: a closed socket's
    listener is gone only once ZeroMQ's I/O thread closed it)."""
    with PortReservation(1) as reservation:
        endpoint = f"tcp://{LOOPBACK}:{reservation.ports[0]}"
        for _ in range(2):  # the task, then its restart on the same address
            context = zmq.Context()
            service = context.socket(zmq.ROUTER)
            client = context.socket(zmq.DEALER)
            try:
                service.bind(endpoint)
                client.connect(endpoint)
                client.send(b"hello")
                assert service.poll(10_000), "the service received nothing in 10 s"
                assert service.recv_multipart()[1] == b"hello"
            finally:
                client.close(0)
                service.close(0)
                context.term()


def test_the_local_backend_holds_the_addresses_asked_for_until_closed() -> None:
    """The launcher holds the ports of the ps tasks that run its own server; a program of
    the user's (a worker, a ``--ps-command``) may bind its port without SO_REUSEADDR."""
    backend = LocalBackend(fork_tasks=False)
    addresses = backend.allocate(["ps:0", "worker:0", "worker:1"], held=["ps:0"])
    ps, *workers = [int(address.rsplit(":", 1)[1]) for address in addresses]
    try:
        assert _plain_bind_error(ps) == errno.EADDRINUSE
        assert all(_plain_bind_error(port) is None for port in workers)
    finally:
        backend.close()
    assert _plain_bind_error(ps) is None
