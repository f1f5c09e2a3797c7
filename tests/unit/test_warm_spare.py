"""A warm spare's wait for its identity (tensorfleet.cluster.warm_spare), on a real named pipe:
it takes the variables the launcher writes and resolves as that task; it exits cleanly when
the pipe is closed, the launcher is gone or its wait passes; a malformed message is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tensorfleet import environment
from tensorfleet.cluster import warm_spare
from tensorfleet.cluster.resolver import resolve_task
from tensorfleet.errors import ClusterConfigError

pytestmark = pytest.mark.timeout(30)

CONFIG = {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}}


@pytest.fixture
def pipe(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A named pipe and the launcher's end of it (read and write, as the launcher holds it)."""
    path = tmp_path / "spare.fifo"
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR)
    try:
        yield path, fd
    finally:
        os.close(fd)


@pytest.fixture
def spare_env(pipe: tuple[Path, int]) -> Iterator[None]:
    """This process as a spare; its whole environment is put back after the test (what a
    spare adopts was not set before, so monkeypatch alone would leave it behind)."""
    saved = dict(os.environ)
    for name in (environment.TF_CONFIG_VAR, environment.PREDECESSOR_DEAD_VAR, "X_SPARE_TEST"):
        os.environ.pop(name, None)
    os.environ[environment.SPARE_PIPE_VAR] = str(pipe[0])
    os.environ[environment.SPARE_WAIT_VAR] = "20"
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_a_spare_becomes_the_task_it_is_handed(
    spare_env: None, pipe: tuple[Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    path, fd = pipe
    config = dict(CONFIG, task={"type": "worker", "index": 1})
    variables = {
        environment.TF_CONFIG_VAR: json.dumps(config),
        environment.PREDECESSOR_DEAD_VAR: "1",
        "X_SPARE_TEST": "yes",
    }
    message = json.dumps({"variables": variables}).encode() + b"\n"
    # written in two pieces, after the spare started waiting
    writer = threading.Thread(target=lambda: (os.write(fd, message[:7]), os.write(fd, message[7:])))
    writer.start()
    task = resolve_task()
    writer.join()
    assert (task.job, task.index, task.source) == ("worker", 1, "TF_CONFIG")
    assert os.environ["X_SPARE_TEST"] == "yes" and environment.predecessor_dead()
    assert environment.SPARE_PIPE_VAR not in os.environ  # no longer a spare
    assert environment.SPARE_WAIT_VAR not in os.environ
    assert capsys.readouterr().out.startswith(warm_spare.READY_LINE + f" (pid {os.getpid()})")
    # a second call resolves at once, as any task's does
    assert resolve_task().index == 1


def test_explicit_environ_is_not_a_spare(spare_env: None) -> None:
    config = dict(CONFIG, task={"type": "worker", "index": 0})
    environ = {environment.TF_CONFIG_VAR: json.dumps(config), environment.SPARE_PIPE_VAR: "x"}
    assert resolve_task(environ=environ).index == 0  # given an environ: no wait


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (b"not json\n", "is not JSON"),
        (b'{"variables": {"A": 1}}\n', "string names and values"),
        (b'{"variables": {"A": "1"}}\n', "names no TF_CONFIG"),
    ],
)
def test_a_malformed_message_is_refused(
    spare_env: None, pipe: tuple[Path, int], message: bytes, error: str
) -> None:
    os.write(pipe[1], message)
    with pytest.raises(ClusterConfigError, match=error):
        warm_spare.wait_for_identity()


def _spare(path: Path, wait_s: str, launcher_pid: int | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env[environment.SPARE_PIPE_VAR], env[environment.SPARE_WAIT_VAR] = str(path), wait_s
    if launcher_pid is not None:
        env[environment.SPARE_LAUNCHER_VAR] = str(launcher_pid)
    code = (
        "from tensorfleet.cluster.resolver import resolve_task; resolve_task(); print('RESOLVED')"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def test_a_spare_exits_cleanly_when_the_pipe_is_closed(tmp_path: Path) -> None:
    path = tmp_path / "spare.fifo"
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR)
    child = _spare(path, "20")
    try:
        assert child.stdout is not None
        assert child.stdout.readline().startswith(warm_spare.READY_LINE)
    finally:
        os.close(fd)  # the launcher goes away: no writer is left
    out, _ = child.communicate(timeout=20)
    assert child.returncode == 0, out
    assert "exiting: its pipe" in out and "was closed" in out and "RESOLVED" not in out, out


def test_a_spare_exits_cleanly_when_its_wait_passes_or_the_launcher_is_gone(
    tmp_path: Path,
) -> None:
    path = tmp_path / "spare.fifo"
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    try:
        waited = _spare(path, "0.5")
        out, _ = waited.communicate(timeout=20)
        assert waited.returncode == 0 and "no task needed it within 0.5 s" in out, out
        orphan = _spare(path, "20", launcher_pid=gone.pid)
        out, _ = orphan.communicate(timeout=20)
        assert orphan.returncode == 0 and f"the launcher (pid {gone.pid}) is gone" in out, out
    finally:
        os.close(fd)
