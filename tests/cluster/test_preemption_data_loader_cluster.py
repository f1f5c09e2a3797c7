"""The whole job stopped (SIGTERM to every task's process group, as the launcher, Slurm and
torchrun do) while the workers read a ``DataLoader`` with worker processes, which die of the
same signal: the run still ends as a preemption, with the chief's checkpoint at that step
(status 143), in ``async`` on a ps and in ``allreduce``, whose checkpoint is collective: a
worker whose loop finds its dead loader before it asks ``should_stop()`` takes part in it
from the session's exit. The same command then resumes at that step.

In ``allreduce`` one worker preempted alone (its own group signalled) takes the others with
it: they agree on the checkpoint at that step and all leave with status 143, instead of
waiting for it at the next collective and failing there."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

from tensorfleet.launch.local_cluster import LocalCluster
from tests.cluster.conftest import PROGRAMS, RecordingOutput

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

PROGRESS = re.compile(r"progress worker=\d+ global_step=(\d+)")
STARTED = re.compile(r"started worker=0 global_step=(\d+)")
STEPS = 100_000  # far past where the SIGTERM comes


def _run(
    tmp_path: Path,
    mode: str,
    num_ps: int,
    stop_after: int | None,
    only: str | None = None,
    asks: bool = True,
) -> tuple[int, RecordingOutput]:
    """Run the program; after ``stop_after`` steps stop the whole job as the launcher does
    on its own SIGTERM, or (``only``) send SIGTERM to that one task's process group."""
    output = RecordingOutput()
    command = [sys.executable, str(PROGRAMS / "loader_worker.py"), str(tmp_path / "ckpt"), mode,
               str(STEPS if stop_after is not None else 1), *([] if asks else ["never-ask"])]  # fmt: skip
    cluster = LocalCluster(
        num_ps, 2, command, output=output, grace_period=10.0, max_restarts=0,
        env={"PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    try:
        cluster.start()
        if stop_after is not None:
            output.wait_for(
                lambda lines: any(
                    int(m.group(1)) >= stop_after for _, t in lines if (m := PROGRESS.search(t))
                ),
                f"global step {stop_after}",
                120,
            )
            if only is None:
                cluster.interrupt()  # as the launcher does on its own SIGTERM
            else:
                cluster.kill_task(only, signal.SIGTERM)  # a preemption of one machine
        code = cluster.wait(timeout=150)
    finally:
        cluster.stop()
    return code, output


@pytest.mark.parametrize(("mode", "num_ps"), [("async", 1), ("allreduce", 0)])
def test_a_stopped_job_reading_a_data_loader_saves_and_resumes(tmp_path, mode, num_ps):
    code, output = _run(tmp_path, mode, num_ps, stop_after=20)
    transcript = output.transcript()
    assert code == 143, transcript
    saved = re.search(
        r"worker:0: preempted \(SIGTERM\) at global step (\d+); checkpoint", transcript
    )
    assert saved, transcript
    step = int(saved.group(1))
    assert (tmp_path / "ckpt" / f"step-{step:08d}").is_dir(), transcript
    _, again = _run(tmp_path, mode, num_ps, stop_after=None)  # resumes, one step more at most
    started = [int(m.group(1)) for _, t in again.lines if (m := STARTED.search(t))]
    assert started == [step], again.transcript()


@pytest.mark.parametrize("asks", [True, False], ids=["asks-should-stop", "never-asks"])
def test_one_preempted_all_reduce_worker_takes_the_group_along_to_its_checkpoint(tmp_path, asks):
    """Also when the loop never asks ``should_stop()``: the session agrees at the start of
    each step that no ``should_stop()`` preceded."""
    code, output = _run(tmp_path, "allreduce", 0, stop_after=20, only="worker:1", asks=asks)
    transcript = output.transcript()
    assert code == 143, transcript
    assert "worker:1: preempted (SIGTERM) at global step" in transcript, transcript
    left = re.search(
        r"worker:0: another worker was preempted \(SIGTERM\): leaving with the group at global "
        r"step (\d+); checkpoint saved",
        transcript,
    )
    assert left, transcript
    assert "DeadlineExceeded" not in transcript, transcript
    step = int(left.group(1))
    assert (tmp_path / "ckpt" / f"step-{step:08d}").is_dir(), transcript
    _, again = _run(tmp_path, "allreduce", 0, stop_after=None)
    started = [int(m.group(1)) for _, t in again.lines if (m := STARTED.search(t))]
    assert started == [step], again.transcript()
