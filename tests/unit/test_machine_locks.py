"""The tests' machine-wide locks (tests/machine_locks.py): one holder at a time, a wait that
ends with the lock's name, and a lock released when its holder's block ends."""

from __future__ import annotations

import pytest

from tests.machine_locks import machine_lock


def test_a_held_lock_makes_a_second_holder_wait_and_fail_naming_it_then_is_free_again():
    name = "test-machine-locks"
    with machine_lock(name):
        with pytest.raises(AssertionError, match="test-machine-locks.*not released within 0.3 s"):
            with machine_lock(name, wait_s=0.3):
                pass
    with machine_lock(name, wait_s=0.3):  # released when the first block ended
        pass
