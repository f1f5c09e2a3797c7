"""The launcher's default restart policy end to end, with small task programs.

A task killed by a signal is restarted by default (with ``TENSORFLEET_PREDECESSOR_DEAD=1``);
a task that exits with an error stops the cluster with its traceback; bad limits are refused
before anything starts. Programs and helpers are those of ``test_launcher_restarts``.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tensorfleet.launch.cli import main
from tensorfleet.launch.local_cluster import LocalCluster
from tests.e2e.test_launcher import SHORT, assert_all_gone, launch_argv, run_launcher
from tests.e2e.test_launcher_restarts import HookedOutput, all_pids, program, runs_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_a_killed_worker_is_restarted_by_default_and_told_its_predecessor_is_dead(
    log: io.StringIO, tmp_path: Path
) -> None:
    ready = threading.Event()

    def on_line(task: str, text: str) -> None:
        if task == "worker:1" and text == "READY worker:1":
            ready.set()

    command = program(tmp_path, "worker:1", "hang-once")
    env_probe = [
        sys.executable,
        "-c",
        "import json, os, subprocess, sys; "
        "print('ENV ' + json.dumps(os.environ.get('TENSORFLEET_PREDECESSOR_DEAD')), flush=True); "
        "rc = subprocess.call(sys.argv[1:]); "
        "sys.exit(128 - rc if rc < 0 else rc)",  # as a shell reports a signal
        *command,
    ]
    lc = LocalCluster(0, 2, env_probe, output=HookedOutput(log, on_line=on_line), **SHORT)
    assert lc.restart_policy.signal_restarts > 0 and lc.max_restarts == 0  # the defaults
    with lc:
        assert ready.wait(20), log.getvalue()
        os.kill(runs_of(log.getvalue())["worker:1"][0]["pid"], signal.SIGKILL)  # kill -9
        status = lc.wait(timeout=40)
    text = log.getvalue()
    assert status == 0, text
    assert lc.restarts == {"worker:0": 0, "worker:1": 1}, text
    assert "worker:1 failed with signal SIGKILL" not in text  # the wrapper reports 137
    assert (
        "worker:1 failed with exit code 137; restarting it (restart 1 of 10) in 1 s (crash-loop back-off: it ran"
        in text
    )
    envs = [line for line in text.splitlines() if line.startswith("[worker:1] ENV ")]
    assert [json.loads(line.split("ENV ", 1)[1]) for line in envs] == [None, "1"], text
    assert [r["run"] for r in runs_of(text)["worker:1"]] == [1, 2], text
    assert_all_gone(all_pids(text), text)


def test_a_worker_killed_after_the_crash_loop_threshold_is_restarted_at_once(
    log: io.StringIO, tmp_path: Path
) -> None:
    from tensorfleet.launch.restart_policy import RestartPolicy

    ready = threading.Event()
    # The task sleeps 1 s before it says READY: it has run longer than the 0.5 s threshold
    # when the test kills it (the launcher counts from the spawn, before the sleep).
    late = [sys.executable, "-c", "import subprocess, sys, time; time.sleep(1.0); "
            "sys.exit(subprocess.call(sys.argv[1:]))", *program(tmp_path, "worker:1", "hang-once")]  # fmt: skip
    lc = LocalCluster(
        0,
        2,
        late,
        output=HookedOutput(
            log, on_line=lambda task, text: text == "READY worker:1" and ready.set()
        ),
        restart_policy=RestartPolicy(crash_loop_s=0.5),
        **SHORT,
    )
    with lc:
        assert ready.wait(20), log.getvalue()
        lc.kill_task("worker:1")
        status = lc.wait(timeout=40)
    text = log.getvalue()
    assert status == 0, text
    assert lc.restarts["worker:1"] == 1, text
    assert re.search(
        r"worker:1 failed with signal SIGKILL; restarting it \(restart 1 of 10\) at once "
        r"\(it ran \d+\.\d s, at least the crash-loop threshold of 0\.5 s\)",
        text,
    ), text
    assert "crash-loop back-off" not in text, text
    assert [r["run"] for r in runs_of(text)["worker:1"]] == [1, 2], text
    assert_all_gone(all_pids(text), text)


def test_an_error_exit_still_stops_the_cluster_by_default(tmp_path: Path) -> None:
    raising = textwrap.dedent(
        """
        import json, os, time
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        print("up", task, flush=True)
        if task["index"] == 1:
            raise RuntimeError("boom in worker 1")
        time.sleep(50)
        """
    )
    argv = launch_argv(
        "--ps", "0", "--workers", "3", "--grace-period", "1", "--kill-timeout", "1",
        "--", sys.executable, "-c", raising,
    )  # fmt: skip
    result = run_launcher(argv, timeout=40)
    text = result.stdout
    assert result.returncode == 1, text
    assert "error: worker:1 failed with exit code 1" in text, text
    report = text[text.index("worker:1 failed with exit code 1") :]
    assert "[worker:1] Traceback (most recent call last):" in report, text
    assert "[worker:1] RuntimeError: boom in worker 1" in report, text
    assert "restarting" not in text, text
    assert "stopping worker:0, worker:2 with SIGTERM" in text, text


def test_a_signal_limit_of_zero_stops_the_cluster_at_the_first_kill(
    log: io.StringIO, tmp_path: Path
) -> None:
    from tensorfleet.launch.restart_policy import RestartPolicy

    ready = threading.Event()
    lc = LocalCluster(
        0,
        2,
        program(tmp_path, "worker:1", "hang-once"),
        output=HookedOutput(
            log, on_line=lambda task, text: text == "READY worker:1" and ready.set()
        ),
        restart_policy=RestartPolicy(signal_restarts=0),
        **SHORT,
    )
    with lc:
        assert ready.wait(20), log.getvalue()
        lc.kill_task("worker:1")
        status = lc.wait(timeout=30)
    text = log.getvalue()
    assert status == 128 + signal.SIGKILL, text
    assert "error: worker:1 failed with signal SIGKILL" in text, text
    assert lc.restarts["worker:1"] == 0, text
    assert_all_gone(all_pids(text), text)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--signal-restarts", "-1"], "signal_restarts must be an integer >= 0, got -1"),
        (["--error-restarts", "-3"], "error_restarts must be an integer >= 0, got -3"),
        (["--max-restarts", "-1"], "max_restarts must be >= 0, got -1"),
        (["--restart-window", "-1"], "--restart-window must be >= 0"),
        (["--ray-address", "127.0.0.1:9"], "add --backend ray"),
    ],
)
def test_bad_restart_limits_are_refused_before_anything_starts(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "started"
    argv = [
        "launch",
        "--no-live",
        *flags,
        "--",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "tensorfleet: error: " in err and message in err, err
    assert not marker.exists()


@pytest.fixture
def log() -> io.StringIO:
    return io.StringIO()
