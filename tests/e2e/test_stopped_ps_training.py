"""A ps that stays stopped (SIGSTOP) is replaced by the launcher, and with the update log the
replacement loses nothing (``launch/stopped_ps.py``): the CNN example on 1 ps + 2 workers
under the launcher's defaults (a warm spare ps; ``auto``: 2 s with the log), the ps stopped
between two checkpoints and never resumed by the test. The launcher kills it, the spare is
restored from the newest checkpoint and replays the log, and comes back at a global step no
lower than the last one a worker printed before the stop (a step line follows its push's
acknowledgement). Training then runs to the end.

Synchronized through the launcher's output; no timing is asserted.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from tensorfleet import environment
from tensorfleet.launch.local_cluster import LocalCluster
from tests.e2e.test_launcher import assert_all_gone
from tests.e2e.test_preemption_launch import DATA, EXAMPLE, STEP_LINE, WatchedOutput, run_beside
from tests.e2e.test_ps_update_log import REPLAYED

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data, pytest.mark.timeout(240)]


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed (make data)")
def test_a_stopped_ps_is_replaced_and_the_update_log_keeps_every_step(tmp_path: Path) -> None:
    command = [
        sys.executable, str(EXAMPLE), "--steps", "100", "--log-every", "1",
        "--train-limit", "3000", "--test-limit", "1000", "--logdir", str(tmp_path / "run"),
        "--checkpoint-steps", "25", "--summary-steps", "100000",
    ]  # fmt: skip
    output = WatchedOutput()
    env = {environment.PS_UPDATE_LOG_VAR: str(tmp_path / "update-log")}
    cluster = LocalCluster(1, 2, command, output=output, ps_spares=1, env=env)
    seen: dict[str, int] = {}

    def stop_the_ps() -> None:
        # past the checkpoint at 25, before the one at 50
        at, _ = output.wait_for("worker:1", STEP_LINE, min_number=35)
        seen["stopped_pid"] = cluster.pids["ps:0"]
        cluster.kill_task("ps:0", signal.SIGSTOP)  # never resumed here
        lines = output.lines()  # the lines printed so far: steps acknowledged
        seen["acknowledged"] = max(
            int(m.group(2))
            for task, text in lines
            if task.startswith("worker:") and (m := STEP_LINE.search(text))
        )
        at, replayed = output.wait_for("ps:0", REPLAYED, at, min_number=0)
        seen["replayed_step"] = int(replayed.group(2))
        seen["checkpoint_step"] = int(replayed.group(3))
        output.wait_for("worker:1", STEP_LINE, at, min_number=seen["replayed_step"] + 5)

    status, failures = run_beside(cluster, stop_the_ps, 200)
    text = output.log.getvalue()
    assert not failures, f"{failures[0]}\n{text}"
    assert status == 0, text
    assert cluster.restarts["ps:0"] == 1, text
    pid = seen["stopped_pid"]
    assert re.search(
        rf"ps:0 \(pid {pid}\) has been stopped for [\d.]+ s .*nothing is lost", text
    ), text
    assert re.search(r"ps:0 was stopped for [\d.]+ s and killed by the launcher", text), text
    assert seen["checkpoint_step"] < seen["acknowledged"], text  # steps to bring back
    assert seen["replayed_step"] >= seen["acknowledged"], (seen, text)
    assert re.search(r"^\[worker:0\] Test accuracy: \d\.\d+", text, re.M), text
    pids = [pid for t in cluster.tasks for pid in [t.pid, *t.previous_pids] if pid is not None]
    assert_all_gone(pids, text)
