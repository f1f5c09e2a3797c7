"""Separate "hosts" on one Linux machine: network namespaces joined by a bridge.

:class:`NetworkNamespaces` creates ``count`` namespaces, each with a loopback interface and
one veth (``eth0``) whose other end is a port of a bridge. The bridge and the host-side veth
ends live in one more namespace of their own (the *hub*), so nothing at all is added to the
root namespace: deleting the namespaces deletes every interface with them. Each namespace
gets an address in a private ``10.213.<random>.0/24`` that is reachable from the others only.

A link is cut by setting the hub-side end of a namespace's veth down: the namespace keeps its
address and sockets, but loses carrier and every packet is dropped until the link is restored,
as when a cable is pulled or a switch port fails.

Names are ``tfl`` plus a random suffix (``tfl3fa9c1-0``, ..., ``tfl3fa9c1-hub``) so that parallel
runs do not collide. Everything needs root; :func:`namespaces_available` says why it cannot be
used on this machine (by trying it), for a skip reason.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from types import TracebackType

#: Every name this harness creates starts with this.
PREFIX = "tfl"
#: Seconds any one ``ip`` command may take.
IP_TIMEOUT_S = 20.0
#: Name of the namespace-side veth end in every namespace.
DEVICE = "eth0"
#: Name of the bridge in the hub namespace.
BRIDGE = "br0"


class NamespaceError(RuntimeError):
    """An ``ip`` command failed; the message holds the command and its output."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise :class:`NamespaceError` with its output when it fails."""
    argv = ["ip", *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NamespaceError(f"`{' '.join(argv)}` could not run: {exc}") from exc
    if check and done.returncode != 0:
        raise NamespaceError(
            f"`{' '.join(argv)}` failed with exit code {done.returncode}: "
            f"{(done.stderr or done.stdout).strip()}"
        )
    return done


def list_namespaces() -> list[str]:
    """The names of the network namespaces that exist now (``ip netns list``)."""
    lines = ip("netns", "list").stdout.splitlines()
    return [line.split()[0] for line in lines if line.strip()]


def random_prefix() -> str:
    """A fresh prefix for one set of namespaces: ``tfl`` and six hex digits."""
    return f"{PREFIX}{secrets.token_hex(3)}"


@functools.cache
def namespaces_available() -> str | None:
    """``None`` when this process can create namespaces, veths and bridges and run commands
    inside a namespace; otherwise why not (not root, no ``ip``, refused by the kernel or the
    container). Found out once per process by creating and deleting a probe namespace."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (this process is not running as root)"
    if shutil.which("ip") is None:
        return "network namespaces need the `ip` command (iproute2), which is not installed"
    probe = f"{random_prefix()}-probe"
    try:
        ip("netns", "add", probe)
    except NamespaceError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        ip("-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb")
        ip("-n", probe, "link", "add", "name", BRIDGE, "type", "bridge")
        ip("-n", probe, "link", "set", "vb", "master", BRIDGE)
        ip("netns", "exec", probe, "true")
    except NamespaceError as exc:
        return f"network namespaces cannot be used here: {exc}"
    finally:
        ip("netns", "delete", probe, check=False)
    if probe in list_namespaces():
        return f"the probe namespace {probe} could not be deleted"
    return None


class NetworkNamespaces:
    """``count`` namespaces on one bridge, each with one address; a context manager.

    Namespaces are named ``<prefix>-0`` ... ``<prefix>-<count-1>`` (:attr:`names`); methods
    take such a name or its index. On leaving the ``with`` block (or when creation fails half
    way) every namespace is deleted, which deletes the veths and the bridge with them.
    Processes started in a namespace must be stopped before that: a namespace outlives its
    name while a process still runs in it.
    """

    def __init__(self, count: int, prefix: str | None = None, subnet: str | None = None):
        if count < 1:
            raise ValueError(f"need at least one namespace, got {count}")
        self.prefix = prefix or random_prefix()
        if len(self.prefix) > 11:
            raise ValueError(f"prefix {self.prefix!r} is too long (at most 11 characters)")
        self.network = ipaddress.IPv4Network(subnet or f"10.213.{secrets.randbelow(254) + 1}.0/24")
        if count > self.network.num_addresses - 3:
            raise ValueError(f"{count} namespaces do not fit in {self.network}")
        #: The namespaces, one per simulated host.
        self.names = [f"{self.prefix}-{i}" for i in range(count)]
        #: The namespace that holds the bridge and the host-side veth ends.
        self.hub = f"{self.prefix}-hub"
        self._created: list[str] = []

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> NetworkNamespaces:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def create(self) -> None:
        """Create the hub with its bridge, then every namespace with its veth and address."""
        self._add_namespace(self.hub)
        ip("-n", self.hub, "link", "add", "name", BRIDGE, "type", "bridge")
        ip("-n", self.hub, "link", "set", BRIDGE, "up")
        for index, name in enumerate(self.names):
            self._add_namespace(name)
            port = self._hub_port(name)
            # Both ends are created directly in their namespaces: nothing in the root namespace.
            ip("link", "add", "name", DEVICE, "netns", name, "type", "veth", "peer", "name", port,
               "netns", self.hub)  # fmt: skip
            ip("-n", self.hub, "link", "set", port, "master", BRIDGE)
            ip("-n", self.hub, "link", "set", port, "up")
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", name, "addr", "add", f"{self.address(index)}/{self.network.prefixlen}",
               "dev", DEVICE)  # fmt: skip
            ip("-n", name, "link", "set", DEVICE, "up")

    def close(self) -> None:
        """Delete every namespace this object created (and so its interfaces). Idempotent;
        raises :class:`NamespaceError` naming those that could not be deleted."""
        failures = []
        for name in reversed(self._created):
            done = ip("netns", "delete", name, check=False)
            if done.returncode != 0 and name in list_namespaces():
                failures.append(f"{name}: {(done.stderr or done.stdout).strip()}")
        self._created = []
        if failures:
            raise NamespaceError(f"could not delete namespaces: {'; '.join(failures)}")

    def remaining(self) -> list[str]:
        """Namespaces with this object's prefix that exist now (none after :meth:`close`)."""
        return [name for name in list_namespaces() if name.startswith(f"{self.prefix}-")]

    # -- use ------------------------------------------------------------------------------------

    def name(self, ns: int | str) -> str:
        """The name of namespace ``ns`` (an index or a name of :attr:`names`)."""
        if isinstance(ns, int):
            return self.names[ns]
        if ns not in self.names:
            raise ValueError(f"{ns!r} is not one of {self.names}")
        return ns

    def address(self, ns: int | str) -> str:
        """The IPv4 address of namespace ``ns`` on the bridge (``10.213.x.2`` for the first)."""
        index = self.names.index(self.name(ns))
        return str(self.network.network_address + 2 + index)

    def exec_argv(self, ns: int | str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside namespace ``ns``. ``ip netns exec`` execs the
        command, so a process started with it has the command's pid."""
        return ["ip", "netns", "exec", self.name(ns), *argv]

    def cut_link(self, ns: int | str) -> None:
        """Take namespace ``ns`` off the network: its bridge port goes down, its ``eth0``
        loses carrier, and every packet to or from it is dropped until :meth:`restore_link`.
        Its sockets stay open (TCP keeps retransmitting)."""
        ip("-n", self.hub, "link", "set", self._hub_port(self.name(ns)), "down")

    def restore_link(self, ns: int | str) -> None:
        """Put namespace ``ns`` back on the network after :meth:`cut_link`."""
        ip("-n", self.hub, "link", "set", self._hub_port(self.name(ns)), "up")

    def link_is_up(self, ns: int | str) -> bool:
        """Whether namespace ``ns``'s bridge port is up."""
        done = ip("-n", self.hub, "-o", "link", "show", self._hub_port(self.name(ns)))
        flags = done.stdout.split("<", 1)[1].split(">", 1)[0].split(",")
        return "UP" in flags

    # -- internals ------------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._created.append(name)

    def _hub_port(self, name: str) -> str:
        """The hub-side veth end of namespace ``name`` (``p0``, ``p1``, ...)."""
        return f"p{self.names.index(name)}"
