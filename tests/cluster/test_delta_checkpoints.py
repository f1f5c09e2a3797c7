"""A ps killed with SIGKILL between two delta checkpoints of the embedding tables: the
launcher restarts it, the chief restores every shard from the newest chain (a full
checkpoint and the deltas after it), the shard's update log replays what it applied since
(the log names a checkpoint by its dense state, which the merged chain holds too), and
training goes on to the end; every checkpoint left on disk reads back whole (keep-last-K
kept the bases the kept deltas need)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

import pytest

import tensorfleet as tfl
from tensorfleet.launch.local_cluster import LocalCluster
from tensorfleet.ps.shard_checkpoint import decode_shard
from tensorfleet.session.checkpoints import CheckpointDirectory, read_chain, read_checkpoint
from tests.cluster.conftest import PROGRAMS, RecordingOutput
from tests.processes import process_alive

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

SAVED = re.compile(r"checkpoint of global step (\d+) saved in (\S+)")
RESTORED = re.compile(r"restor(?:ed|ing) checkpoint .*step-(\d+) \(global step (\d+)\)")
LINE_TIMEOUT_S = 90.0
RUN_TIMEOUT_S = 150.0
LAST_STEP = 200


def _kind(path: Path) -> str:
    return json.loads((path / "manifest.json").read_text()).get("kind", "full")


def test_a_ps_killed_between_two_delta_checkpoints_restores_from_the_chain_and_trains_on(
    tmp_path: Path,
) -> None:
    output = RecordingOutput()
    checkpoint_dir, result_path = tmp_path / "checkpoints", tmp_path / "result.json"
    command = [
        sys.executable,
        str(PROGRAMS / "delta_table_worker.py"),
        str(checkpoint_dir),
        str(result_path),
        str(LAST_STEP),
    ]
    ps_command = [sys.executable, "-m", "tensorfleet", "server", "--liveness-timeout", "4",
                  "--update-log", str(tmp_path / "update-log")]  # fmt: skip
    cluster = LocalCluster(
        2,
        1,
        command,
        ps_command=ps_command,
        output=output,
        grace_period=20.0,
        max_restarts=1,
        env={"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    outcome: dict[str, object] = {}

    def supervise() -> None:
        try:
            outcome["returncode"] = cluster.wait(timeout=RUN_TIMEOUT_S)
        except BaseException as exc:  # reported below, with the transcript
            outcome["failure"] = exc

    cluster.start()
    thread = threading.Thread(target=supervise, daemon=True)
    thread.start()
    try:
        delta: list[tuple[int, Path]] = []

        def a_delta_was_saved(lines: list[tuple[str, str]]) -> bool:
            for name, text in lines:
                match = SAVED.search(text)
                if name == "worker:0" and match and _kind(Path(match.group(2))) == "delta":
                    delta.append((int(match.group(1)), Path(match.group(2))))
                    return True
            return False

        output.wait_for(a_delta_was_saved, "a delta checkpoint saved", LINE_TIMEOUT_S)
        saved_step = delta[0][0]
        cluster.kill_task("ps:1", signal.SIGKILL)  # before the next checkpoint (another delta)
        # no checkpoint is written while ps:1 is down: these are the ones it died between
        kinds_then = {
            step: _kind(path)
            for step, path in CheckpointDirectory(checkpoint_dir).step_directories()
        }
        assert kinds_then[saved_step] == "delta", kinds_then
        thread.join(RUN_TIMEOUT_S + 10)
        assert "failure" not in outcome, f"{outcome['failure']!r}\n{output.transcript()}"
        assert outcome.get("returncode") == 0, f"{outcome}\n{output.transcript()}"
    finally:
        if thread.is_alive():  # the test failed early: stop the tasks now
            cluster.interrupt(signal.SIGTERM)
            thread.join(30)
        if not thread.is_alive():
            cluster.stop()
        pids = [p for t in cluster.tasks for p in [t.pid, *t.previous_pids] if p is not None]
        leftovers = [pid for pid in pids if process_alive(pid)]
        assert not leftovers, f"processes left behind: {leftovers}\n{output.transcript()}"
    transcript = output.transcript()
    assert cluster.restarts["ps:1"] == 1, transcript
    restored = [int(m.group(2)) for t in output.of("worker:0") if (m := RESTORED.search(t))]
    assert restored, f"the chief never restored a checkpoint\n{transcript}"
    # the newest checkpoint when the ps died: the delta seen, or a later one of its chain
    assert restored[-1] == max(kinds_then) >= saved_step, (restored, kinds_then, transcript)
    assert kinds_then[restored[-1]] == "delta", (restored, kinds_then)
    # The update log found the delta's segment (it names the dense state the merged chain
    # holds too) and replayed what the killed process applied since: no step lost.
    killed = "\n".join(output.of("ps:1"))
    assert "no update log of this checkpoint" not in killed, transcript
    assert re.search(r"replayed \d+ updates of the update log", killed), transcript
    result = json.loads(result_path.read_text())
    assert result["global_step"] >= LAST_STEP, result
    assert result["loss_after"] < result["loss_before"], result
    sparse_filters = 0
    for _, path in CheckpointDirectory(checkpoint_dir).step_directories():
        read_chain(path)  # every chain left is complete
        if _kind(path) == "delta":  # the admission filter: only its changed counters
            for document in read_checkpoint(path).documents:
                users = decode_shard(document).tables.get("users")
                sparse_filters += users is not None and b"admission_filter_at" in users[:4096]
    assert sparse_filters > 0, transcript
    ids, values = tfl.load_table_rows(checkpoint_dir, "users")
    assert ids.numel() == values.shape[0] > 0
