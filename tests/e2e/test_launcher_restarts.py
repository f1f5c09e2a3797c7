"""The launcher's restarts end to end: ``max_restarts`` / ``--max-restarts`` and ``kill_task``.

The tasks run :data:`PROGRAM`, a small inline Python program that counts its runs in a
marker file under ``tmp_path`` (one per task), prints what the launcher gave it, and then
behaves as told: fail on its first run only, always fail, or hang on its first run until it
is killed. Tests synchronize through process exits and through lines and messages as the
launcher's output object receives them; nothing waits on a sleep, and no test asserts a
timing. After every test, every process a task reported (every run's pid) must be gone.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tensorfleet.errors import DeadlineExceeded, LaunchError
from tensorfleet.launch.cli import main
from tensorfleet.launch.local_cluster import LocalCluster
from tensorfleet.launch.output import PlainOutput
from tests.e2e.test_launcher import (
    SHORT,
    assert_all_gone,
    fake,
    launch_argv,
    reported_pids,
    run_launcher,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

#: argv: MARKER_DIR TARGET MODE. Every task appends to MARKER_DIR/<job>-<index>.runs and
#: prints ``RUN {json}`` (its run number, pid, TF_CONFIG, secret). TARGET (``worker:1``) then
#: follows MODE: ``fail-once=CODE`` exits CODE on its first run only, ``always=CODE`` on every
#: run, ``hang-once`` prints ``READY job:index`` and waits (at most a minute) on its first
#: run. Every other task, and every run MODE does not fail, exits 0.
PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path

    marker_dir, target, mode = sys.argv[1:4]
    config = json.loads(os.environ["TF_CONFIG"])
    name = f"{config['task']['type']}:{config['task']['index']}"
    marker = Path(marker_dir) / (name.replace(":", "-") + ".runs")
    with marker.open("a") as f:
        f.write("x")
    run = len(marker.read_text())
    info = {
        "run": run,
        "pid": os.getpid(),
        "tf_config": config,
        "secret": os.environ.get("TENSORFLEET_SECRET"),
    }
    print("RUN " + json.dumps(info), flush=True)
    if name == target:
        kind, _, code = mode.partition("=")
        if kind == "always" or (kind == "fail-once" and run == 1):
            print(f"failing on purpose, run {run}", flush=True)
            sys.exit(int(code))
        if kind == "hang-once" and run == 1:
            print(f"READY {name}", flush=True)
            time.sleep(60)
            sys.exit(9)  # never killed: the test failed; exit anyway
    print(f"done {name}", flush=True)
    """
)


def program(marker_dir: Path, target: str, mode: str) -> list[str]:
    """argv of :data:`PROGRAM` with its arguments."""
    return [sys.executable, "-c", PROGRAM, str(marker_dir), target, mode]


def runs_of(text: str) -> dict[str, list[dict]]:
    """The ``RUN`` infos every task printed, in order, by task name."""
    runs: dict[str, list[dict]] = {}
    for match in re.finditer(r"^\[(\w+:\d+)\] RUN (.*)$", text, re.MULTILINE):
        runs.setdefault(match.group(1), []).append(json.loads(match.group(2)))
    return runs


def all_pids(text: str) -> list[int]:
    """The pid of every run of every task."""
    return [info["pid"] for infos in runs_of(text).values() for info in infos]


def expected_config(lc: LocalCluster, name: str) -> dict:
    job, _, index = name.partition(":")
    return {"cluster": lc.cluster, "task": {"type": job, "index": int(index)}}


class HookedOutput(PlainOutput):
    """One stream for task lines and launcher messages, calling a hook on each (from the
    reader threads for lines, from the supervising thread for messages)."""

    def __init__(
        self,
        log: io.StringIO,
        on_line: Callable[[str, str], None] | None = None,
        on_message: Callable[[str], None] | None = None,
    ):
        super().__init__(log, log)
        self.on_line, self.on_message = on_line, on_message

    def line(self, task: str, text: str) -> None:
        super().line(task, text)
        if self.on_line is not None:
            self.on_line(task, text)

    def message(self, text: str, level: str = "info") -> None:
        super().message(text, level)
        if self.on_message is not None:
            self.on_message(text)


@pytest.fixture
def log() -> io.StringIO:
    return io.StringIO()


# ---------------------------------------------------------------- LocalCluster from Python


def test_failed_worker_is_restarted_with_the_same_identity(
    log: io.StringIO, tmp_path: Path
) -> None:
    # No ps task: this program's ps would exit 0 at once, and a ps cluster whose chief and ps
    # tasks all exited 0 has completed its training (launch/training_completion.py), after
    # which nothing is restarted. A real ps exits only once every worker is done or lost.
    command = program(tmp_path, "worker:1", "fail-once=3")
    lc = LocalCluster(0, 2, command, output=HookedOutput(log), max_restarts=1, **SHORT)
    with lc:
        status = lc.wait(timeout=30)
    text = log.getvalue()
    assert status == 0, text
    assert lc.restarts == {"worker:0": 0, "worker:1": 1}, text
    assert lc.returncodes == {"worker:0": 0, "worker:1": 0}, text
    assert "worker:1 failed with exit code 3; restarting it (restart 1 of 1)" in text, text
    assert "restarted worker:1 (restart 1 of 1)" in text, text

    runs = runs_of(text)
    assert [r["run"] for r in runs["worker:1"]] == [1, 2], text
    assert len(runs["worker:0"]) == 1, text  # exit 0: once
    first, second = runs["worker:1"]
    # The same identity: the same TF_CONFIG (so the same address), the same secret.
    assert first["tf_config"] == second["tf_config"] == expected_config(lc, "worker:1"), text
    assert first["secret"] == second["secret"] == lc.secret, text
    # A new process, and the one the launcher reports now.
    assert first["pid"] != second["pid"], text
    assert lc.pids["worker:1"] == second["pid"], text
    assert "[worker:1] done worker:1" in text, text  # the same output prefix after the restart
    assert "error" not in text, text
    assert_all_gone(all_pids(text), text)


def test_without_restarts_the_same_failure_stops_the_run(log: io.StringIO, tmp_path: Path) -> None:
    lc = LocalCluster(0, 2, program(tmp_path, "worker:1", "fail-once=3"), output=HookedOutput(log))
    assert lc.max_restarts == 0  # the default
    with lc:
        status = lc.wait(timeout=30)
    text = log.getvalue()
    assert status == 3, text
    assert lc.restarts == {"worker:0": 0, "worker:1": 0}, text
    assert [r["run"] for r in runs_of(text)["worker:1"]] == [1], text
    assert "error: worker:1 failed with exit code 3" in text, text
    assert "restart" not in text, text
    assert_all_gone(all_pids(text), text)


def test_task_that_always_fails_is_restarted_n_times_then_reported(
    log: io.StringIO, tmp_path: Path
) -> None:
    lc: LocalCluster | None = None
    refused: list[str] = []

    def kill_while_pending(text: str) -> None:
        # A task waiting for its restart is not running: kill_task refuses it.
        if "restarting it" in text and lc is not None:
            try:
                lc.kill_task("worker:1")
            except LaunchError as exc:
                refused.append(str(exc))

    lc = LocalCluster(
        1,
        2,
        program(tmp_path, "worker:1", "always=4"),
        ps_command=fake("--hang", "*"),
        output=HookedOutput(log, on_message=kill_while_pending),
        max_restarts=2,
        **SHORT,
    )
    with lc:
        status = lc.wait(timeout=40)
    text = log.getvalue()
    assert status == 4, text
    assert lc.restarts == {"ps:0": 0, "worker:0": 0, "worker:1": 2}, text
    runs = runs_of(text)["worker:1"]
    assert [r["run"] for r in runs] == [1, 2, 3], text
    assert all(r["tf_config"] == expected_config(lc, "worker:1") for r in runs), text
    for n in (1, 2):
        assert f"worker:1 failed with exit code 4; restarting it (restart {n} of 2)" in text, text
    assert "restart 3 of" not in text, text
    # The final report names the restarts used, with the last run's pid and last lines.
    assert re.search(
        rf"error: worker:1 failed with exit code 4 \(pid {runs[-1]['pid']}, after [\d.]+ s; "
        r"restarts used: 2 of 2, all that --error-restarts / --max-restarts allow\)",
        text,
    ), text
    report = text[text.index("restarts used: 2 of 2") :]
    assert "[worker:1] failing on purpose, run 3" in report, text
    assert "failing on purpose, run 2" not in report, text  # only the last run's lines
    assert sum(ln.startswith("RUN ") for ln in lc.recent_lines("worker:1")) == 1, text
    assert "stopping ps:0 with SIGTERM" in text, text
    assert lc.returncodes["ps:0"] == -signal.SIGTERM, text
    assert len(refused) == 2 and "waits to be restarted" in refused[0], (refused, text)
    assert_all_gone(all_pids(text), text)


def test_kill_task_restarts_a_running_worker(log: io.StringIO, tmp_path: Path) -> None:
    ready = threading.Event()

    def on_line(task: str, text: str) -> None:
        if task == "worker:1" and text == "READY worker:1":
            ready.set()

    lc = LocalCluster(
        0,
        2,
        program(tmp_path, "worker:1", "hang-once"),
        output=HookedOutput(log, on_line=on_line),
        max_restarts=1,
        **SHORT,
    )
    with pytest.raises(LaunchError, match="not started"):
        lc.kill_task("worker:1")
    with lc:
        assert ready.wait(20), log.getvalue()
        first_pid = lc.pids["worker:1"]
        with pytest.raises(LaunchError, match="no task 'worker:7'"):
            lc.kill_task("worker:7")
        lc.kill_task("worker:1")
        status = lc.wait(timeout=30)
        text = log.getvalue()
        with pytest.raises(LaunchError, match="worker:1 is not running: it already ended"):
            lc.kill_task("worker:1")
    assert status == 0, text
    assert lc.restarts == {"worker:0": 0, "worker:1": 1}, text
    assert "worker:1 failed with signal SIGKILL; restarting it (restart 1 of 1)" in text, text
    runs = runs_of(text)["worker:1"]
    assert [r["pid"] for r in runs] == [first_pid, lc.pids["worker:1"]], text
    assert runs[0]["tf_config"] == runs[1]["tf_config"] == expected_config(lc, "worker:1"), text
    assert lc.returncodes == {"worker:0": 0, "worker:1": 0}, text
    assert_all_gone(all_pids(text), text)


def test_stop_kills_a_restarted_task(log: io.StringIO) -> None:
    ready = [threading.Event(), threading.Event()]  # READY of the first run, of the second

    def on_line(task: str, text: str) -> None:
        if task == "worker:0" and text == "READY worker:0":
            next(event for event in ready if not event.is_set()).set()

    lc = LocalCluster(
        0, 1, fake("--hang", "*"), output=HookedOutput(log, on_line=on_line), max_restarts=1
    )
    try:
        lc.start()
        assert ready[0].wait(20), log.getvalue()
        first_pid = lc.pids["worker:0"]
        lc.kill_task("worker:0", signal.SIGTERM)  # any signal the launcher did not send
        # Supervise (the restart happens in wait()) until the new process is up.
        deadline = time.monotonic() + 20
        while not ready[1].is_set() and time.monotonic() < deadline:
            with contextlib.suppress(DeadlineExceeded):
                lc.wait(timeout=0.1)
        assert ready[1].is_set(), log.getvalue()
        second_pid = lc.pids["worker:0"]
    finally:
        status = lc.stop()
    text = log.getvalue()
    assert second_pid != first_pid and lc.restarts == {"worker:0": 1}, text
    assert "worker:0 failed with signal SIGTERM; restarting it (restart 1 of 1)" in text, text
    assert status == 128 + signal.SIGTERM, text
    assert lc.returncodes == {"worker:0": -signal.SIGTERM}, text
    assert "worker:0 ended: stopped (SIGTERM)" in text, text
    assert_all_gone([first_pid, second_pid], text)


def test_leftovers_of_a_failed_task_are_killed_before_its_restart(log: io.StringIO) -> None:
    lc = LocalCluster(
        0,
        1,
        fake("--grandchild", "worker:0", "--exit", "worker:0=2"),
        output=HookedOutput(log),
        max_restarts=1,
        **SHORT,
    )
    with lc:
        status = lc.wait(timeout=30)
    text = log.getvalue()
    assert status == 2, text
    assert lc.restarts == {"worker:0": 1}, text
    assert "worker:0 left processes behind in its process group; killing them before " in text
    assert "restarts used: 1 of 1, all that --error-restarts / --max-restarts allow" in text, text
    # One grandchild per run, each as the task printed it (the report repeats the last one).
    grandchildren = [int(pid) for pid in re.findall(r"^\[worker:0\] GRANDCHILD (\d+)$", text, re.M)]
    assert len(set(grandchildren)) == 2, text
    assert_all_gone(reported_pids(text) + grandchildren, text)


def test_no_restart_once_the_run_is_interrupted(log: io.StringIO, tmp_path: Path) -> None:
    lc: LocalCluster | None = None

    def interrupt_during_backoff(text: str) -> None:
        if "restarting it" in text and lc is not None:
            lc.interrupt(signal.SIGTERM)

    lc = LocalCluster(
        1,
        2,
        program(tmp_path, "worker:1", "fail-once=3"),
        ps_command=fake("--hang", "*"),
        output=HookedOutput(log, on_message=interrupt_during_backoff),
        max_restarts=3,
        **SHORT,
    )
    with lc:
        status = lc.wait(timeout=30)
    text = log.getvalue()
    assert status == 128 + signal.SIGTERM, text
    assert "worker:1 failed with exit code 3; restarting it (restart 1 of 3)" in text, text
    assert "not restarting worker:1: the run is interrupted" in text, text
    assert "restarted worker:1" not in text, text
    assert lc.restarts["worker:1"] == 0, text
    assert [r["run"] for r in runs_of(text)["worker:1"]] == [1], text
    assert lc.returncodes["ps:0"] == -signal.SIGTERM, text
    assert_all_gone(all_pids(text), text)


def test_invalid_max_restarts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(LaunchError, match="max_restarts must be >= 0, got -1"):
        LocalCluster(0, 1, fake(), max_restarts=-1)
    argv = ["launch", "--no-live", "--max-restarts", "-1", "--", sys.executable, "-c", "pass"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "tensorfleet: error: max_restarts must be >= 0, got -1" in err, err


# ---------------------------------------------------------------- the command line


def test_cli_max_restarts(tmp_path: Path) -> None:
    argv = launch_argv(
        "--ps", "0", "--workers", "2", "--max-restarts", "1", "--grace-period", "1",
        "--", *program(tmp_path, "worker:1", "fail-once=3"),
    )  # fmt: skip
    result = run_launcher(argv, timeout=40)
    text = result.stdout
    assert result.returncode == 0, text
    assert (
        "[launcher] warning: worker:1 failed with exit code 3; restarting it (restart 1 of 1)"
        in (text)
    ), text
    runs = runs_of(text)
    assert [r["run"] for r in runs["worker:1"]] == [1, 2], text
    assert runs["worker:1"][0]["tf_config"] == runs["worker:1"][1]["tf_config"], text
    assert runs["worker:1"][0]["tf_config"]["task"] == {"type": "worker", "index": 1}, text
    assert "[launcher] all 2 worker(s) finished" in text, text
    assert_all_gone(all_pids(text), text)


def test_cli_help_names_max_restarts() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tensorfleet", "launch", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=20,
    )
    assert result.returncode == 0, result.stdout
    assert "--max-restarts N" in result.stdout, result.stdout
