"""The same-host all-reduce (``HostAllReduce``) with three real gloo processes: buckets of
varying sizes through the two slots give every rank the rank-order mean bit for bit (one
larger than a slot goes over gloo), DDP's gradients through the hook equal gloo's, and a
worker that dies mid-run makes the others fail at the barrier with an error naming the
bucket, within the group's deadline, instead of waiting; a worker that cannot map the
others' memory keeps the whole group on gloo, each saying why."""

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


def test_a_rank_that_cannot_map_the_others_keeps_the_whole_group_on_gloo_and_says_why() -> None:
    ranks = run_gloo_ranks(PROGRAM, WORLD, TIMEOUT_S, {"REFUSE_MAP": "1"})
    assert ranks.codes == [0] * WORLD, ranks.transcript
    assert ranks.outputs[1].startswith(
        "GLOO worker 1 could not map the others' shared memory: /proc/PID/fd/N cannot be opened"
    ), ranks.transcript
    for rank in (0, 2):
        assert ranks.outputs[rank].startswith(
            "GLOO another worker could not map the shared memory (its output says why)"
        ), ranks.transcript
