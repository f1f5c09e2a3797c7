"""A ps task whose process stays stopped is killed and restarted by the launcher
(``launch/stopped_ps.py``); one it may not restart is left alone with one line saying why.

The cluster's commands are plain ``sleep`` programs (no training): what is tested is the
launcher's watch of the process state. Synchronized on the launcher's messages and the
process states, with a deadline each; no timing is asserted. The whole path with training,
the update log and a warm spare: ``tests/e2e/test_ps_update_log.py``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tensorfleet import environment
from tensorfleet.errors import LaunchConfigError
from tensorfleet.launch.local_cluster import LocalCluster
from tensorfleet.launch.output import PlainOutput
from tensorfleet.launch.restart_policy import DEFAULT_POLICY
from tensorfleet.launch.stopped_ps import (
    AFTER_WITH_LOG_S,
    AFTER_WITHOUT_LOG_S,
    AUTO,
    parse_after,
    process_state,
)
from tests.e2e.test_preemption_launch import run_beside

pytestmark = pytest.mark.timeout(90)

WAIT_S = 30.0
SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]
#: Restarted at once, however short the process's run (no crash-loop back-off to wait).
NO_BACKOFF = dataclasses.replace(DEFAULT_POLICY, crash_loop_s=0.0)


class Messages(PlainOutput):
    """The launcher's messages and the tasks' lines, and a wait for one that matches."""

    def __init__(self) -> None:
        self.log = io.StringIO()
        super().__init__(self.log, self.log)
        self._changed = threading.Condition()
        self._messages: list[str] = []

    def message(self, text: str, level: str = "info") -> None:
        super().message(text, level)
        with self._changed:
            self._messages.append(text)
            self._changed.notify_all()

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The first launcher message that matches ``pattern``, within :data:`WAIT_S`."""
        found: list[re.Match[str]] = []

        def seen() -> bool:
            found[:] = [m for text in self._messages if (m := re.search(pattern, text))][:1]
            return bool(found)

        with self._changed:
            if not self._changed.wait_for(seen, WAIT_S):
                raise AssertionError(
                    f"no launcher message matched {pattern!r} within {WAIT_S} s\n"
                    + self.log.getvalue()
                )
        return found[0]


def wait_until(condition: Callable[[], bool], what: str, log: io.StringIO) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_S} s\n{log.getvalue()}")
        time.sleep(0.02)


def supervise(cluster: LocalCluster, drive: Callable[[], None]) -> list[BaseException]:
    """Start ``cluster``, run ``drive`` beside its supervision, then interrupt and stop it
    (its sleepers never end by themselves): what ``drive`` raised (an empty list: nothing)."""

    def drive_then_interrupt() -> None:
        try:
            drive()
        finally:
            cluster.interrupt(signal.SIGTERM)

    return run_beside(cluster, drive_then_interrupt, WAIT_S * 2)[1]


def test_the_state_of_a_stopped_process_is_read_from_proc() -> None:
    child = subprocess.Popen(SLEEPER)
    try:
        log = io.StringIO()
        wait_until(lambda: process_state(child.pid) in ("S", "R"), "running", log)
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(child.pid) == "T", "stopped", log)
        os.kill(child.pid, signal.SIGCONT)
        wait_until(lambda: process_state(child.pid) != "T", "resumed", log)
    finally:
        child.kill()
        child.wait(WAIT_S)
    assert process_state(child.pid) is None  # reaped: nothing to read


def test_the_option_takes_auto_off_or_seconds() -> None:
    assert parse_after("auto") == AUTO
    assert parse_after(" Auto ") == AUTO
    assert parse_after("off") is None
    assert parse_after("0") is None
    assert parse_after("2.5") == 2.5
    for bad in ("soon", "inf", "nan", ""):
        with pytest.raises(LaunchConfigError, match=r"is not a number of seconds: give auto.*off"):
            parse_after(bad)
    with pytest.raises(LaunchConfigError, match=r"'-1': the seconds must be 0 or more; give auto"):
        parse_after("-1")


def test_auto_waits_less_when_the_update_log_keeps_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(environment.PS_UPDATE_LOG_VAR, raising=False)
    cases = [
        ({}, None, AUTO, AFTER_WITHOUT_LOG_S),
        ({environment.PS_UPDATE_LOG_VAR: str(tmp_path)}, None, AUTO, AFTER_WITH_LOG_S),
        ({}, ["tensorfleet", "server", "--update-log", str(tmp_path)], AUTO, AFTER_WITH_LOG_S),
        ({}, None, 7.5, 7.5),
        ({}, None, None, None),
    ]
    for env, ps_command, choice, expected in cases:
        cluster = LocalCluster(
            1, 1, SLEEPER, env=env, ps_command=ps_command, replace_stopped_ps=choice
        )
        try:
            assert cluster.stopped_ps_after() == expected, (env, ps_command, choice)
        finally:
            cluster.stop()
    without_ps = LocalCluster(0, 1, SLEEPER)
    try:
        assert without_ps.stopped_ps_after() is None
    finally:
        without_ps.stop()
    with pytest.raises(LaunchConfigError, match="replace_stopped_ps=-1"):
        LocalCluster(1, 1, SLEEPER, replace_stopped_ps=-1)


def test_a_ps_that_stays_stopped_is_killed_and_restarted() -> None:
    output = Messages()
    cluster = LocalCluster(
        1, 1, SLEEPER, ps_command=SLEEPER, output=output, restart_policy=NO_BACKOFF,
        replace_stopped_ps=0.5,
    )  # fmt: skip
    seen: dict[str, int] = {}

    def drive() -> None:
        wait_until(lambda: cluster.task("ps:0").running, "ps:0 started", output.log)
        first = cluster.pids["ps:0"]
        seen["first"] = first
        cluster.kill_task("ps:0", signal.SIGSTOP)
        said = output.wait_for(rf"ps:0 \(pid {first}\) has been stopped for ([\d.]+) s")
        assert float(said.group(1)) >= 0.5, output.log.getvalue()
        output.wait_for(r"ps:0 was stopped for [\d.]+ s and killed by the launcher; restarting it")
        wait_until(lambda: cluster.restarts["ps:0"] == 1, "ps:0 restarted", output.log)
        wait_until(lambda: cluster.task("ps:0").running, "ps:0 running again", output.log)
        seen["second"] = cluster.pids["ps:0"]
        assert process_state(seen["second"]) != "T", output.log.getvalue()
        wait_until(lambda: process_state(first) is None, "the stopped ps gone", output.log)

    failures = supervise(cluster, drive)
    text = output.log.getvalue()
    assert not failures, f"{failures[0]}\n{text}"
    assert seen["second"] != seen["first"], text
    assert "the steps since its newest checkpoint are trained again" in text, text


def test_a_stopped_ps_the_policy_would_not_restart_is_left_alone() -> None:
    output = Messages()
    never = dataclasses.replace(NO_BACKOFF, signal_restarts=0)
    cluster = LocalCluster(
        1, 1, SLEEPER, ps_command=SLEEPER, output=output, restart_policy=never,
        replace_stopped_ps=0.3,
    )  # fmt: skip

    def drive() -> None:
        wait_until(lambda: cluster.task("ps:0").running, "ps:0 started", output.log)
        pid = cluster.pids["ps:0"]
        cluster.kill_task("ps:0", signal.SIGSTOP)
        output.wait_for(rf"ps:0 \(pid {pid}\) has been stopped for [\d.]+ s; not replacing it")
        assert process_state(pid) == "T", output.log.getvalue()  # left as it was
        assert cluster.restarts["ps:0"] == 0, output.log.getvalue()
        cluster.kill_task("ps:0", signal.SIGCONT)
        wait_until(lambda: process_state(pid) != "T", "ps:0 resumed", output.log)

    failures = supervise(cluster, drive)
    text = output.log.getvalue()
    assert not failures, f"{failures[0]}\n{text}"
    assert text.count("not replacing it") == 1, text  # said once, not at every look
