"""Locks on what a test uses of the whole machine, for tests that run side by side.

``make test`` runs the tests in two processes at once (pytest-xdist, ``--dist loadfile``:
each file's tests in one of them). Almost every test owns what it uses (free ports, its own
temporary directories, the processes it starts); a few look at the machine as a whole, and
two such tests in the two processes would see each other. Each holds the lock named for
what it uses while it uses it:

* ``ray``: ``tests/e2e/test_ray_backend.py`` runs a one-node Ray cluster, and
  ``tests/unit/test_ray_backend_errors.py`` checks Ray's message when it finds no cluster on
  this machine (it would find the other's and skip).

A lock is an ``flock`` on a file in the temporary directory, so a test killed while holding
it (a timeout, a crash of its process) releases it with its process. Waiting for a lock has a
deadline: a holder that never lets go fails the waiter with an error naming the lock.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: How long a test waits for another to release a lock: the longest holder, the Ray module,
#: holds it 35-45 s on a busy 2-core machine; below the waiting tests' own timeout (120 s), so
#: that this lock's message, not the timeout's, says what a hang was waiting for.
WAIT_S = 90.0


@contextmanager
def machine_lock(name: str, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold the machine-wide lock ``name`` (see the module) for the ``with`` block; an
    AssertionError naming it if it is not free within ``wait_s`` seconds."""
    path = Path(tempfile.gettempdir()) / f"tensorfleet-tests-{name}.lock"
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"the test lock {name!r} ({path}) was not released within {wait_s} s: "
                        "another test holding it hangs, or a process outside the tests holds it"
                    ) from None
                time.sleep(0.1)  # flock has no timed wait; a holder's exit is not an event here
        yield
    finally:
        os.close(descriptor)  # releases the lock with the descriptor
