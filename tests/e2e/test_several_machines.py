"""docs/howto/several-machines.md by hand: ``tensorfleet server`` and the example started as
separate processes (one per machine there), the cluster given with the classic per-job host
lists, the secret only in a file given with ``--secret-file``, the traffic encrypted with
``--encrypt`` on every task. Nothing comes from the environment: had one program ignored an
option, its task could not find the secret or would not agree on encryption."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet import environment
from tensorfleet.cluster.spec import ClusterSpec, TaskId
from tensorfleet.cluster.thread_budget import co_located_threads
from tensorfleet.environment import host_cpu_count
from tensorfleet.launch.ports import LOOPBACK, free_ports
from tensorfleet.wire.secret import generate_secret
from tests.e2e.test_example import needs_fashion_mnist

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data, pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist_cnn.py"
#: Variables that would give a task its identity, secret or encryption behind the options' back.
CLEARED = (
    environment.TF_CONFIG_VAR,
    environment.SECRET_VAR,
    environment.SECRET_FILE_VAR,
    environment.ENCRYPT_VAR,
    environment.LAUNCHER_VAR,
    environment.INTRA_OP_THREADS_VAR,
)


@needs_fashion_mnist
def test_server_and_example_with_host_lists_a_secret_file_and_encryption(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(generate_secret() + "\n")
    secret.chmod(0o600)
    ps, worker0, worker1 = (f"{LOOPBACK}:{port}" for port in free_ports(3))
    hosts = [f"--ps_hosts={ps}", f"--worker_hosts={worker0},{worker1}"]
    options = [*hosts, "--secret-file", str(secret), "--encrypt"]
    example = [
        sys.executable, str(EXAMPLE), *options, "--steps", "20", "--log-every", "10",
        "--train-limit", "1000", "--test-limit", "200", "--progress-secs", "600",
    ]  # fmt: skip
    commands = {
        "ps:0": [sys.executable, "-m", "tensorfleet", "server", *options, "--job", "ps", "--task", "0"],
        "worker:1": [*example, "--job_name", "worker", "--task_index", "1"],
        "worker:0": [*example, "--job_name", "worker", "--task_index", "0"],
    }  # fmt: skip
    env = {name: value for name, value in os.environ.items() if name not in CLEARED}
    logs = {name: tmp_path / f"{name.replace(':', '-')}.log" for name in commands}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, argv in commands.items():
            with logs[name].open("wb") as log:  # a file, not a pipe: nobody must read it meanwhile
                processes[name] = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path
                )
        for process in processes.values():
            process.wait(timeout=200)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)
    outputs = {name: log.read_text() for name, log in logs.items()}
    report = "\n".join(f"--- {name} ---\n{text}" for name, text in outputs.items())
    assert {name: p.returncode for name, p in processes.items()} == dict.fromkeys(commands, 0), (
        report
    )
    assert re.search(r"^Test accuracy: [\d.]+ \(global step \d+\)$", outputs["worker:0"], re.M), (
        report
    )
    assert "parameter service ended (finished)" in outputs["ps:0"], report
    # Three tasks named on this host: the ps plans its share of the cores, as the launcher
    # would (cluster/thread_budget.py), and says so.
    cores = host_cpu_count()
    threads = co_located_threads(
        ClusterSpec({"ps": [ps], "worker": [worker0, worker1]}), TaskId("ps", 0), cores
    )[0]
    line = f"ps:0: {threads} torch thread(s) for applying updates (planned: {cores} core(s), 3 task(s) of the cluster on this host; --threads N to choose)"
    assert line in outputs["ps:0"], report
    # Where its secret came from, and that --encrypt took effect (a new user found no line
    # saying either).
    security = f"ps:0: messages authenticated with the cluster secret from secret file {secret}; every message sealed with AES-256-GCM (--encrypt)"
    assert security in outputs["ps:0"], report
