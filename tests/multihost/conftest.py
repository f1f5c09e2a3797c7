"""Multi-host tests: every task on its own "host", a Linux network namespace of its own.

They need root (to create namespaces, veths and a bridge) and are skipped, with the reason
:func:`~tests.multihost.netns.namespaces_available` found, where namespaces cannot be used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .netns import NetworkNamespaces, namespaces_available

MARKER = "multihost"


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker (pyproject.toml lists it too, for ``--strict-markers`` runs)."""
    config.addinivalue_line(
        "markers", f"{MARKER}: runs tasks in separate Linux network namespaces (needs root)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``multihost`` test, with the reason, when namespaces cannot be used."""
    marked = [item for item in items if item.get_closest_marker(MARKER) is not None]
    if not marked:
        return
    reason = namespaces_available()
    if reason is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def network_namespaces() -> Iterator[Callable[[int], NetworkNamespaces]]:
    """A factory of :class:`NetworkNamespaces`, created at once. All of them are deleted at
    teardown, whatever the test did, and none with their prefix may remain afterwards."""
    made: list[NetworkNamespaces] = []

    def make(count: int) -> NetworkNamespaces:
        net = NetworkNamespaces(count)
        made.append(net)
        net.create()
        return net

    try:
        yield make
    finally:
        errors = []
        for net in made:
            try:
                net.close()
            except Exception as exc:  # keep closing the others
                errors.append(repr(exc))
        left = [name for net in made for name in net.remaining()]
        assert not errors and not left, (
            f"namespaces left behind: {left}; errors while deleting: {errors}"
        )
