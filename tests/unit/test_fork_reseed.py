"""Forked children (a warm sweep's trials, a launcher's forked tasks) get torch random states
of their own, as fresh interpreters of this torch do, unless the forking process's code set a
seed itself (then they keep it, as a fresh interpreter running that code would)."""

from __future__ import annotations

import os

import pytest
import torch

from tensorfleet import process_forks


def seeds_of_forked_children(count: int = 2) -> list[int]:
    """``torch.initial_seed()`` in ``count`` children forked from here, each after
    ``reseed_generators()``."""
    seeds = []
    for _ in range(count):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its seed, then leave at once
            try:
                process_forks.reseed_generators()
                os.write(write, str(torch.initial_seed()).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            seeds.append(int(pipe.read()))
        os.waitpid(pid, 0)
    return seeds


@pytest.fixture(autouse=True)
def restore_start_seed():
    saved = process_forks._torch_start_seed
    yield
    process_forks._torch_start_seed = saved


def test_children_forked_after_torch_was_imported_get_seeds_of_their_own() -> None:
    if torch.initial_seed() == process_forks.TORCH_FIXED_DEFAULT_SEED:
        pytest.skip("this torch starts every process with the same fixed seed")
    process_forks.note_torch_start_seed()
    first, second = seeds_of_forked_children()
    assert first != second and torch.initial_seed() not in (first, second)


def test_a_seed_set_after_the_import_is_kept_in_every_child() -> None:
    process_forks.note_torch_start_seed()
    state = torch.get_rng_state()
    try:
        torch.manual_seed(1234)  # the user's preloaded code seeds torch itself
        assert seeds_of_forked_children() == [1234, 1234]
    finally:
        torch.set_rng_state(state)
