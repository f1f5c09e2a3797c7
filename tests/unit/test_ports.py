"""Free localhost ports for the tasks of a local cluster."""

from __future__ import annotations

import socket

import pytest

from tensorfleet.launch.ports import LOOPBACK, free_port, free_ports


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


def test_foreign_address_is_an_error() -> None:
    with pytest.raises(OSError):
        free_ports(1, "192.0.2.1")  # TEST-NET-1: never an address of this machine
