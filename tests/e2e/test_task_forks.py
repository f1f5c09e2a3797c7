"""Tasks forked from the launcher's task fork server behave as fresh interpreters would, and
everything that cannot be served starts fresh and says why (tensorfleet.launch.backends.task_forks).

Real processes: the probe program (programs/fork_probe.py) says how it was started; a task
forked from the server is the only kind that finds torch imported before its first line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tensorfleet.launch.backends.task_forks import ForkableCommand, TaskForkServer
from tensorfleet.launch.local_cluster import LocalCluster
from tests.cluster.conftest import RecordingOutput
from tests.processes import process_alive

pytestmark = pytest.mark.timeout(120)

PROBE = Path(__file__).parent / "programs" / "fork_probe.py"


def _env(**more: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(sys.path), **more}


def _probes(output: RecordingOutput, task: str) -> list[dict]:
    return [
        json.loads(line[len("PROBE ") :]) for line in output.of(task) if line.startswith("PROBE {")
    ]


def _run(cluster: LocalCluster, output: RecordingOutput, timeout_s: float = 90.0) -> int:
    try:
        cluster.start()
        return cluster.wait(timeout=timeout_s)
    except BaseException as exc:
        raise AssertionError(f"cluster run failed: {exc!r}\n{output.transcript()}") from exc
    finally:
        cluster.stop()
        left = [name for name, pid in cluster.pids.items() if process_alive(pid)]
        assert not left, f"processes left behind: {left}\n{output.transcript()}"


def _probe_cluster(
    tmp_path: Path,
    output: RecordingOutput,
    workers: int,
    worker_args: list[str],
    fork_tasks: bool | None = True,
    **options: Any,
) -> LocalCluster:
    """1 ps (the probe, sleeping) and ``workers`` workers running the probe with
    ``worker_args``, in ``tmp_path``, forked from the task fork server unless ``fork_tasks``
    says otherwise (None: as the launcher's environment says)."""
    return LocalCluster(
        1,
        workers,
        [sys.executable, str(PROBE), *worker_args],
        ps_command=[sys.executable, str(PROBE), "sleep", "60"],
        env=options.pop("env", None) or _env(),
        output=output,
        cwd=tmp_path,
        fork_tasks=fork_tasks,
        **options,
    )


def test_forked_tasks_see_what_a_fresh_interpreter_would(tmp_path: Path) -> None:
    output = RecordingOutput()
    cluster = _probe_cluster(
        tmp_path,
        output,
        2,
        ["thread", "atexit"],
        env=_env(PROBE_VALUE="shared"),
        task_env={"worker:1": {"PROBE_VALUE": "own"}},
        grace_period=2.0,
    )
    assert _run(cluster, output) == 0, output.transcript()
    draws = []
    for task, value in (("worker:0", "shared"), ("worker:1", "own")):
        (probe,) = _probes(output, task)
        assert probe["torch_before"], f"{task} was not forked\n{output.transcript()}"
        assert probe["name"] == "__main__"
        assert probe["argv"] == [str(PROBE), "thread", "atexit"]
        assert probe["path0"] == str(PROBE.parent)
        assert probe["cwd"] == str(tmp_path)
        assert probe["value"] == value
        assert probe["pgid_is_pid"]
        assert probe["task"] == {"type": "worker", "index": int(task[-1])}
        draws.append(probe["draw"])
        lines = output.of(task)
        ended = lines.index("PROBE main code ended")
        # the interpreter's end: non-daemon threads first, then the exit handlers
        assert lines[ended + 1 :] == ["THREAD done after the main code", "ATEXIT ran"], lines
    assert draws[0] != draws[1], "forked tasks share Python's generator state"
    assert _probes(output, "ps:0")[0]["torch_before"]


def test_a_forked_tasks_output_is_unbuffered_as_the_launcher_asks(tmp_path: Path) -> None:
    output = RecordingOutput()
    cluster = _probe_cluster(tmp_path, output, 1, ["unflushed", "sleep", "60"], kill_timeout=1.0)
    try:
        cluster.start()
        for line in ("UNFLUSHED stdout line", "UNFLUSHED stderr line"):
            output.wait_for(
                lambda lines, line=line: ("worker:0", line) in lines, f"{line} (unflushed)", 60
            )
    finally:
        cluster.stop()
    assert _probes(output, "worker:0")[0]["torch_before"], output.transcript()


def test_tasks_start_fresh_when_forks_are_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORFLEET_TASK_FORKS", "0")  # in the launcher's environment
    output = RecordingOutput()
    cluster = _probe_cluster(tmp_path, output, 1, [], fork_tasks=None, grace_period=2.0)
    assert _run(cluster, output) == 0, output.transcript()
    assert not _probes(output, "worker:0")[0]["torch_before"]
    assert not _probes(output, "ps:0")[0]["torch_before"]


def test_a_task_whose_import_time_variables_differ_starts_fresh_and_says_why(
    tmp_path: Path,
) -> None:
    output = RecordingOutput()
    cluster = _probe_cluster(
        tmp_path,
        output,
        2,
        [],
        task_env={"worker:1": {"OMP_NUM_THREADS": "1"}},
        grace_period=2.0,
    )
    assert _run(cluster, output) == 0, output.transcript()
    assert _probes(output, "worker:0")[0]["torch_before"]
    assert not _probes(output, "worker:1")[0]["torch_before"]
    said = [line for line in output.of("worker:1") if "fresh interpreter" in line]
    assert said and "OMP_NUM_THREADS" in said[0], output.transcript()


def test_a_killed_fork_server_costs_its_tasks_a_restart_in_a_fresh_interpreter(
    tmp_path: Path,
) -> None:
    output = RecordingOutput()
    cluster = _probe_cluster(tmp_path, output, 1, ["sleep", "4"], grace_period=2.0)
    try:
        cluster.start()
        output.wait_for(
            lambda lines: any(t == "worker:0" and s.startswith("PROBE {") for t, s in lines),
            "worker:0's probe line",
            60,
        )
        server = cluster.backend.fork_server
        assert server is not None
        server.process.send_signal(signal.SIGKILL)
        assert cluster.wait(timeout=90) == 0, output.transcript()
    finally:
        cluster.stop()
    first, again = _probes(output, "worker:0")
    assert first["torch_before"] and not again["torch_before"], output.transcript()
    assert "worker:0 failed with signal SIGKILL" in output.transcript()
    said = [s for _, s in output.lines if "fresh interpreter" in s]
    assert said and "task fork server" in said[0] and "ended" in said[0], output.transcript()
    assert "left processes behind" not in output.transcript()
    left = [name for name, pid in cluster.pids.items() if process_alive(pid)]
    assert not left and not process_alive(server.process.pid), output.transcript()


class _Server:
    """A task fork server driven directly: fork the probe, collect its output and exit."""

    def __init__(self) -> None:
        self.server = TaskForkServer({**os.environ, **_env(PYTHONUNBUFFERED="1")})
        assert self.server.wait_ready(90.0) is None, self.server.describe_death()
        self.ended: dict[int, threading.Event] = {}

    def fork(self, *args: str) -> tuple[int, int]:
        """The task's pid and the read end of its output."""
        read_end, write_end = os.pipe()
        done = threading.Event()
        pid = self.server.fork(
            ForkableCommand("script", str(PROBE), list(args)),
            {**os.environ, **_env(PYTHONUNBUFFERED="1")},
            os.getcwd(),
            write_end,
            done.set,
        )
        os.close(write_end)
        assert isinstance(pid, int), pid
        self.ended[pid] = done
        return pid, read_end

    def finish(self, pid: int, read_end: int) -> tuple[int | None, str]:
        assert self.ended[pid].wait(60), f"task {pid} never reported its end"
        with os.fdopen(read_end, "rb") as pipe:
            text = pipe.read().decode()
        return self.server.returncode(pid), text


def test_exit_statuses_are_those_of_a_fresh_interpreter() -> None:
    server = _Server()
    try:
        cases = {
            "exit": (server.fork("exit", "3"), 3, "PROBE {"),
            "raise": (server.fork("raise"), 1, "ValueError: the probe raised on purpose"),
            "ok": (server.fork(), 0, "PROBE main code ended"),
        }
        sleeping, sleeping_out = server.fork("sleep", "60")
        terminated, terminated_out = server.fork("sleep", "60")
        for (pid, read_end), code, words in cases.values():
            returncode, text = server.finish(pid, read_end)
            assert returncode == code and words in text, (returncode, text)
        os.killpg(sleeping, signal.SIGKILL)
        os.killpg(terminated, signal.SIGTERM)
        assert server.finish(sleeping, sleeping_out)[0] == -signal.SIGKILL
        assert server.finish(terminated, terminated_out)[0] == -signal.SIGTERM
    finally:
        server.server.close()
    assert server.server.process.returncode is not None


def test_a_killed_server_takes_its_tasks_and_reports_them_killed() -> None:
    server = _Server()
    try:
        pid, read_end = server.fork("sleep", "60")
        server.server.process.send_signal(signal.SIGKILL)
        returncode, _ = server.finish(pid, read_end)
        assert returncode == -signal.SIGKILL
        assert not process_alive(pid)
        why = server.server.fork(
            ForkableCommand("script", str(PROBE)), dict(os.environ), "/", 1, lambda: None
        )
        assert isinstance(why, str) and "task fork server" in why and "ended" in why, why
    finally:
        server.server.close()


def test_a_malformed_request_is_declined_and_the_server_serves_on() -> None:
    server = _Server()
    try:
        why = server.server.fork(
            ForkableCommand("shell", "rm -rf /"), {"A": "1"}, "/", 1, lambda: None
        )
        assert isinstance(why, str) and "documented types" in why, why
        pid, read_end = server.fork()
        assert server.finish(pid, read_end)[0] == 0
    finally:
        server.server.close()
