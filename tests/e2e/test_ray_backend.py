"""``tensorfleet launch --backend ray`` on a real Ray cluster started by the test.

The test starts a one-node Ray cluster (``ray start --head --block``, its own temporary
directory and a free port, in its own process group) and stops it afterwards, checking that
none of its processes, and none of the tasks, is left. The example trains to its accuracy
line through Ray actors; the launcher's restart policy restarts a task killed there; an
address that does not answer is refused before anything starts.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_launcher import assert_all_gone, launch_argv, run_launcher
from tests.e2e.test_launcher_restarts import program, runs_of
from tests.e2e.test_preemption_launch import FIRST_RESTART
from tests.machine_locks import machine_lock

ray = pytest.importorskip("ray", reason="pip install 'tensorfleet[ray]' (make test does)")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist_cnn.py"
DATA = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
RAY_START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if text in cmdline and state not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A one-node Ray cluster for this module: its GCS address; everything stopped after.
    Held under the machine's ``ray`` lock (:mod:`tests.machine_locks`): another test process
    looks for a Ray cluster on this machine."""
    with machine_lock("ray"):
        yield from _ray_cluster()


def _ray_cluster() -> Iterator[str]:
    """Start the cluster (``ray start --head --block``), yield its address, stop it."""
    ray_bin = Path(sys.executable).with_name("ray")
    temp_dir = tempfile.mkdtemp(prefix="tfray-", dir="/tmp")  # Ray's socket paths are short
    port = _free_port()
    log_path = Path(temp_dir) / "ray-start.log"
    with log_path.open("wb") as log:
        head = subprocess.Popen(
            [
                str(ray_bin), "start", "--head", "--block", "--port", str(port),
                "--num-cpus", "4", "--temp-dir", temp_dir, "--node-ip-address", "127.0.0.1",
                "--include-dashboard=false", "--disable-usage-stats",
            ],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + RAY_START_TIMEOUT_S
        while b"--block" not in log_path.read_bytes() or head.poll() is not None:
            assert head.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)  # polls a log file written by another program: no event to wait on
        yield address
    finally:
        # `ray start --block` takes about 30 s to stop its processes on SIGTERM here; the
        # cluster is the test's own and throwaway, so it gets 5 s, then SIGKILL (the loop
        # below still checks that nothing of it is left).
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        deadline = time.monotonic() + 20
        while (left := _processes_mentioning(temp_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left after stopping the cluster: {left}"


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed (make data)")
def test_the_example_trains_on_a_ray_cluster(ray_address: str) -> None:
    argv = launch_argv(
        "--backend", "ray", "--ray-address", ray_address, "--ps", "1", "--workers", "2",
        "--", sys.executable, str(EXAMPLE), "--steps", "40", "--log-every", "20",
        "--train-limit", "2000", "--test-limit", "500", "--progress-secs", "2",
    )  # fmt: skip
    result = run_launcher(argv, timeout=200)
    text = result.stdout
    assert result.returncode == 0, text
    assert "starting 1 ps and 2 worker task(s) on ray" in text, text
    assert re.search(r"^\[worker:0\] Test accuracy: \d\.\d+ \(global step \d+", text, re.M), text
    assert re.search(r"^\[worker:0\] \[progress\] global step \d+/40 ", text, re.M), text
    assert re.search(r"^\[ps:0\] ps:0: ", text, re.M), text  # the ps's own log, prefixed
    for task in ("ps:0", "worker:0", "worker:1"):
        assert f"[launcher] {task} ended: exited 0" in text, text


def test_a_task_killed_on_ray_is_restarted_by_the_launchers_policy(
    ray_address: str, tmp_path: Path
) -> None:
    argv = launch_argv(
        "--backend", "ray", "--ray-address", ray_address, "--ps", "0", "--workers", "2",
        "--grace-period", "2", "--", *program(tmp_path, "worker:1", "hang-once"),
    )  # fmt: skip
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:  # bounded by the test's timeout
            seen.append(line)
            if line.strip() == "[worker:1] READY worker:1":
                break
        first = runs_of("".join(seen))["worker:1"][0]
        os.kill(first["pid"], signal.SIGKILL)  # the task runs on this machine's Ray node
        rest, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    text = "".join(seen) + rest
    assert launcher.returncode == 0, text
    assert re.search(
        rf"worker:1 failed with signal SIGKILL; restarting it \({FIRST_RESTART}\)",
        text,
    ), text
    assert re.search(
        rf"restarted worker:1 \({FIRST_RESTART}\) as pid \d+ on [\d.]+",
        text,
    ), text
    runs = runs_of(text)["worker:1"]
    assert [r["run"] for r in runs] == [1, 2], text
    assert runs[0]["tf_config"] == runs[1]["tf_config"], text  # the same address: same node
    assert_all_gone([r["pid"] for infos in runs_of(text).values() for r in infos], text)


def test_an_address_that_does_not_answer_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "started"
    argv = launch_argv(
        "--backend", "ray", "--ray-address", f"127.0.0.1:{_free_port()}",
        "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')",
    )  # fmt: skip
    result = run_launcher(argv, timeout=60)
    assert result.returncode == 2, result.stdout
    assert "tensorfleet: error: the Ray cluster at 127.0.0.1:" in result.stdout, result.stdout
    assert "does not answer" in result.stdout and "ray start --head" in result.stdout
    assert "Traceback" not in result.stdout and not marker.exists(), result.stdout
