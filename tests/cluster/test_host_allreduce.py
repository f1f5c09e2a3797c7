"""The same-host all-reduce (``HostAllReduce``) with three real gloo processes: buckets of
varying sizes through the two slots give every rank the rank-order mean bit for bit (one
larger than a slot goes over gloo), DDP's gradients through the hook equal gloo's, and a
worker that dies mid-run makes the others fail at the barrier with an error naming the
bucket, within the group's deadline, instead of waiting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tensorfleet.launch.ports import free_port

from .conftest import PROGRAMS

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(150)]
TIMEOUT_S = 100
WORLD = 3


def _run_ranks(extra_env: dict[str, str]) -> tuple[list[int | None], str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(WORLD),
        "OMP_NUM_THREADS": "1",
        **extra_env,
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, str(PROGRAMS / "host_allreduce_rank.py")],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for proc in ranks:
            try:
                out, _ = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                out = "(timed out)"
            outputs.append(out)
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    transcript = "\n".join(f"--- rank {k} ---\n{out}" for k, out in enumerate(outputs))
    return [proc.returncode for proc in ranks], transcript


def test_three_ranks_get_the_rank_order_mean_bit_for_bit_and_ddp_matches_gloo() -> None:
    codes, transcript = _run_ranks({})
    assert codes == [0] * WORLD, transcript
    assert transcript.count("CALLS 28 OVERSIZED 1") == WORLD, transcript
    assert transcript.count("\nOK") == WORLD, transcript


def test_a_rank_that_dies_makes_the_others_fail_at_the_barrier_naming_the_bucket() -> None:
    codes, transcript = _run_ranks({"DIE_AT": "4"})
    assert codes == [4, 4, 3], transcript
    assert transcript.count("DEADLINE worker ") == 2, transcript
    assert "the same-host all-reduce of gradient bucket 4 found a worker missing" in transcript
