"""A warm spare ps end to end (``launch/warm_spares.py``, ``--ps-spares``): the built-in
``tensorfleet server`` started ahead of time waits, past its imports, in
``resolve_server_task``; the ps of the CNN example is killed with SIGKILL, the launcher hands
its identity to the spare, which listens on the ps's address; the chief restores it from the
newest checkpoint and training goes on to the end; a new spare starts behind the used one,
and nothing is left running.

Synchronized through the launcher's output and ``wait_spare_ready``; no timing is asserted.
"""

from __future__ import annotations

import re
import shlex
import signal
import sys
from pathlib import Path

import pytest

from tensorfleet.launch.local_cluster import LocalCluster
from tests.e2e.test_launcher import assert_all_gone, launch_argv, run_launcher
from tests.e2e.test_preemption_launch import (
    DATA,
    EXAMPLE,
    FIRST_RESTART,
    STEP_LINE,
    WAIT_S,
    WatchedOutput,
    run_beside,
)
from tests.e2e.test_warm_spares import QUICK

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data, pytest.mark.timeout(300)]

RESTORING = re.compile(r"restoring checkpoint \S+ \(global step (\d+)\)")
PS_SPARES = re.compile(r"started warm spare ps-(\d+) for the ps tasks as pid (\d+)")


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed (make data)")
def test_a_killed_ps_is_taken_over_by_the_warm_spare_and_restored(tmp_path: Path) -> None:
    command = [
        sys.executable, str(EXAMPLE), "--steps", "150", "--log-every", "1",
        "--train-limit", "3000", "--test-limit", "1000", "--logdir", str(tmp_path / "run"),
        "--checkpoint-steps", "20", "--summary-steps", "100000",
    ]  # fmt: skip
    output = WatchedOutput()
    cluster = LocalCluster(1, 2, command, output=output, ps_spares=1)
    seen: dict[str, int] = {}

    def kill_the_ps() -> None:
        spare = cluster.wait_spare_ready(WAIT_S, job="ps")
        assert spare is not None, "no ps spare waited for an identity\n" + output.log.getvalue()
        seen["spare"] = spare
        at, _ = output.wait_for("worker:1", STEP_LINE, min_number=30)
        cluster.kill_task("ps:0", signal.SIGKILL)
        at, restored = output.wait_for("worker:0", RESTORING, at)
        seen["restored_step"] = int(restored.group(1))
        output.wait_for("worker:1", STEP_LINE, at, min_number=seen["restored_step"] + 5)

    status, failures = run_beside(cluster, kill_the_ps, 240)
    text = output.log.getvalue()
    assert not failures, f"{failures[0]}\n{text}"
    assert status == 0, text
    assert cluster.restarts["ps:0"] == 1, text
    assert re.search(
        rf"restarted ps:0 \({FIRST_RESTART}\) as pid {seen['spare']}: warm spare ps-1, "
        r"started [\d.]+ s ago and waiting",
        text,
    ), text
    spares = {int(n): int(pid) for n, pid in PS_SPARES.findall(text)}
    assert spares[1] == seen["spare"] and 2 in spares, text  # a new spare behind the used one
    assert seen["restored_step"] > 0, text  # from a checkpoint, not re-created from scratch
    assert re.search(r"^\[worker:0\] Test accuracy: \d\.\d+", text, re.M), text
    assert "warm spare waiting for an identity" not in text, text
    pids = [pid for t in cluster.tasks for pid in [t.pid, *t.previous_pids] if pid is not None]
    assert_all_gone([*pids, *spares.values()], text)


def test_the_launcher_keeps_a_ps_spare_by_default_only_for_a_ps_command_that_waits() -> None:
    """One ps spare by default when the ps runs the built-in server or the user's script
    (``--ps-runs-script``: it calls ``resolve_task`` as the worker spares need), none with
    ``--ps-spares 0`` or an arbitrary ``--ps-command`` (it may not wait for an identity)."""
    quick = QUICK  # leaves the marker that its task got to work: the spares start then
    cases = (
        (("--ps-runs-script",), 1),
        (("--ps-runs-script", "--ps-spares", "0"), 0),
        (("--ps-command", f"{sys.executable} -c {shlex.quote(quick)}"), 0),
    )
    spares: list[int] = []
    for flags, expected in cases:
        argv = launch_argv(
            "--ps", "1", "--workers", "1", "--spares", "0", *flags,
            "--", sys.executable, "-c", quick,
        )  # fmt: skip
        result = run_launcher(argv, timeout=60)
        text = result.stdout
        assert result.returncode == 0, f"{flags}\n{text}"
        started = [int(pid) for _, pid in PS_SPARES.findall(text)]
        assert len(started) == expected, f"{flags}\n{text}"
        assert "[ps:0] up None" in text, text  # the task itself is no spare
        spares += started
    assert_all_gone(spares, "ps spares of the runs above")


def test_ps_spares_with_the_ray_backend_are_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tensorfleet.launch.cli import main

    argv = ["launch", "--backend", "ray", "--ps-spares", "1", "--", sys.executable, "x.py"]
    status = main(argv)
    err = capsys.readouterr().err
    assert status != 0
    assert "--ps-spares 1: warm spares need the local backend, not --backend ray" in err, err
