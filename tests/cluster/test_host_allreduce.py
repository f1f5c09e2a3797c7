"""The same-host all-reduce (``HostAllReduce``) with three real gloo processes: buckets of
varying sizes through the two slots give every rank the rank-order mean bit for bit (one
larger than a slot goes over gloo), DDP's gradients through the hook equal gloo's, and a
worker that dies mid-run makes the others fail at the barrier with an error naming the
bucket, within the group's deadline, instead of waiting."""

from __future__ import annotations

import pytest

from .conftest import PROGRAMS, run_gloo_ranks

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(150)]
TIMEOUT_S = 100
WORLD = 3
PROGRAM = PROGRAMS / "host_allreduce_rank.py"


def test_three_ranks_get_the_rank_order_mean_bit_for_bit_and_ddp_matches_gloo() -> None:
    ranks = run_gloo_ranks(PROGRAM, WORLD, TIMEOUT_S)
    codes, transcript = ranks.codes, ranks.transcript
    assert codes == [0] * WORLD, transcript
    assert transcript.count("CALLS 28 OVERSIZED 1") == WORLD, transcript
    assert transcript.count("\nOK") == WORLD, transcript


def test_a_rank_that_dies_makes_the_others_fail_at_the_barrier_naming_the_bucket() -> None:
    ranks = run_gloo_ranks(PROGRAM, WORLD, TIMEOUT_S, {"DIE_AT": "4"})
    codes, transcript = ranks.codes, ranks.transcript
    assert codes == [4, 4, 3], transcript
    assert transcript.count("DEADLINE worker ") == 2, transcript
    assert "the same-host all-reduce of gradient bucket 4 found a worker missing" in transcript
