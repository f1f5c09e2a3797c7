"""Real cluster managers started by the tests (a single-node Slurm), once per session."""

from __future__ import annotations

import time

import pytest

from tests.clusters_real.slurm_harness import SingleNodeSlurm, install, unavailable_reason


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running single-node Slurm; skipped, saying why, where the daemons cannot run."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    started = time.monotonic()
    install()
    installed = time.monotonic()
    cluster = SingleNodeSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        print(
            f"\nslurm: installed in {installed - started:.1f} s, daemons up in "
            f"{time.monotonic() - installed:.1f} s"
        )
        yield cluster
    finally:
        cluster.stop()
