"""The CNN example on a real single-node Slurm: ``srun -n 4`` and an sbatch script written by
``tensorfleet slurm``; 1 ps + 3 workers resolved from Slurm's variables in every task.

The tasks get no TF_CONFIG and no flags, so a task that did not find the cluster in Slurm's
variables would train alone and print its own accuracy line: exactly one accuracy line, from
rank 1 (worker:0, the chief; rank 0 is the ps), shows that all four found the same cluster.
Each task reports its exit status through a small wrapper, and every one must be 0.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet.launch.cli import main
from tensorfleet.launch.ports import free_ports

pytestmark = [pytest.mark.slurm, pytest.mark.needs_data, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "mnist_cnn.py"
DATA = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
#: Global steps of the example in each run: enough for the test accuracy to be well above
#: chance whatever order the three async workers' pushes land in (20 once gave 0.2985
#: against the bar of 0.3 on a loaded machine).
STEPS = "40"
#: How long the short-time-limit job runs: long enough to meet slurmctld's periodic
#: time-limit check, which sends the signal (the old script was requeued within it).
SHORT_JOB_S = 35
RUN_TIMEOUT_S = 300
#: Runs the task, then prints its rank and exit status (srun's --label prefixes the rank).
REPORT_EXIT = '"$@"; code=$?; echo "task exit status: $code"; exit $code'
LABELED_RE = re.compile(r"^\s*(\d+): (.*)$")

needs_fashion_mnist = pytest.mark.skipif(
    not DATA.exists(),
    reason="Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist, as `make test` does when apt is usable)",
)


def task_command() -> list[str]:
    return ["bash", "-c", REPORT_EXIT, "report-exit", sys.executable, str(EXAMPLE), "--steps", STEPS]  # fmt: skip


def consecutive_free_ports(count: int) -> int:
    """A base port with ``count`` free ports from it (the Slurm layout uses base + local rank)."""
    for _ in range(100):
        base = free_ports(1)[0]
        if base + count <= 65536 and all(_bindable(base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"found no {count} consecutive free ports in 100 tries")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(os.urandom(32).hex())
    return path


def check_run(output: str, describe: str) -> None:
    """Every rank exited 0, and only the chief (rank 1) printed a test accuracy."""
    by_rank: dict[int, list[str]] = {}
    for line in output.splitlines():
        match = LABELED_RE.match(line)
        if match:
            by_rank.setdefault(int(match.group(1)), []).append(match.group(2))
    statuses = {
        rank: [line for line in lines if line.startswith("task exit status:")]
        for rank, lines in by_rank.items()
    }
    assert sorted(statuses) == [0, 1, 2, 3], f"expected ranks 0..3\n{describe}"
    assert all(s == ["task exit status: 0"] for s in statuses.values()), f"{statuses}\n{describe}"
    accuracy = {
        rank: [line for line in lines if line.startswith("Test accuracy:")]
        for rank, lines in by_rank.items()
    }
    assert [rank for rank, lines in accuracy.items() if lines] == [1], (
        f"one accuracy line, from the chief (rank 1), expected\n{describe}"
    )
    value = float(re.match(r"Test accuracy: ([0-9.]+)", accuracy[1][0]).group(1))
    assert value > 0.3, f"test accuracy {value} after {STEPS} steps (chance is 0.1)\n{describe}"


def run_client(command: list[str], slurm, cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            command, env=slurm.env, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        subprocess.run(["scancel", "--user", "root"], env=slurm.env, timeout=10)
        raise AssertionError(
            f"{command[0]} ran past {RUN_TIMEOUT_S} s\n{exc.stdout}\n{exc.stderr}\n{slurm.logs()}"
        ) from None


@needs_fashion_mnist
def test_srun_runs_the_example_as_1_ps_and_3_workers(slurm_cluster, tmp_path):
    env_extra = {
        "TENSORFLEET_SECRET_FILE": str(secret_file(tmp_path)),
        "TENSORFLEET_SLURM_BASE_PORT": str(consecutive_free_ports(4)),
    }
    slurm_cluster.env.update(env_extra)
    try:
        command = ["srun", "-n", "4", "--overcommit", "--label", "--kill-on-bad-exit=1", "--time=10", *task_command()]  # fmt: skip
        run = run_client(command, slurm_cluster, ROOT)
    finally:
        for name in env_extra:
            slurm_cluster.env.pop(name)
    describe = f"$ {' '.join(command)}\nexit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert run.returncode == 0, f"{describe}\n{slurm_cluster.logs()}"
    check_run(run.stdout, describe)


@needs_fashion_mnist
def test_sbatch_runs_the_script_tensorfleet_slurm_writes(slurm_cluster, tmp_path, capsys):
    script, log = tmp_path / "job.sbatch", tmp_path / "job-%j.out"
    code = main(
        [
            "slurm", "--ps", "1", "--workers", "3", "--overcommit", "--time", "10",
            "--base-port", str(consecutive_free_ports(4)),
            "--secret-file", str(tmp_path / "secret"), "--log", str(log), "-o", str(script),
            "--", *task_command(),
        ]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert oct((tmp_path / "secret").stat().st_mode & 0o777) == "0o600"
    state, exit_code, record = slurm_cluster.run_batch_job(script, ROOT, RUN_TIMEOUT_S)
    logs = list(tmp_path.glob("job-*.out"))
    output = logs[0].read_text() if logs else "(no job log)"
    describe = f"$ sbatch {script}\n{state}, exit {exit_code}\n{record}\n--- script ---\n{script.read_text()}\n--- job log ---\n{output}"  # fmt: skip
    assert (state, exit_code) == ("COMPLETED", 0), f"{describe}\n{slurm_cluster.logs()}"
    check_run(output, describe)


def test_a_step_smaller_than_the_shape_fails_in_every_task_naming_both_numbers(slurm_cluster):
    slurm_cluster.env.update(TENSORFLEET_SLURM_NUM_PS="1", TENSORFLEET_SLURM_NUM_WORKERS="3")
    try:
        resolve = "import tensorfleet as tfl; tfl.resolve_task()"
        command = ["srun", "-n", "3", "--overcommit", "--label", "--time=2", sys.executable, "-c", resolve]  # fmt: skip
        run = run_client(command, slurm_cluster, ROOT)
    finally:
        slurm_cluster.env.pop("TENSORFLEET_SLURM_NUM_PS")
        slurm_cluster.env.pop("TENSORFLEET_SLURM_NUM_WORKERS")
    describe = f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert run.returncode != 0, describe
    errors = [line for line in run.stderr.splitlines() if "allocation is smaller" in line]
    assert len(errors) == 3, describe
    assert "=3 but the shape is 1 ps + 3 workers = 4 tasks" in errors[0], describe


def test_a_short_time_limit_runs_to_the_end_not_requeued_at_once(slurm_cluster, tmp_path):
    """The tryout's job, `--time 2` with the default requeue signal at 120 s, was requeued
    one second after it got its node, and again at every run. Now the generator leaves the
    signal out for so short a limit: the job runs its command to the end, never requeued.
    The command runs long enough to meet slurmctld's periodic time-limit check, which sends
    the signal: with the old script (signal at 120 s) the job was requeued within it."""
    script, secret = tmp_path / "short.sbatch", tmp_path / "secret"
    command = f"sleep {SHORT_JOB_S}; echo 'ran to the end'"
    code = main(
        [
            "slurm", "--ps", "0", "--workers", "1", "--time", "2",
            "--secret-file", str(secret), "--log", str(tmp_path / "short-%j.out"),
            "-o", str(script), "--", "bash", "-c", command,
        ]
    )  # fmt: skip
    assert code == 0
    state, exit_code, record = slurm_cluster.run_batch_job(script, ROOT, SHORT_JOB_S + 60)
    logs = list(tmp_path.glob("short-*.out"))
    output = logs[0].read_text() if logs else "(no job log)"
    describe = f"{state}, exit {exit_code}\n{record}\n--- script ---\n{script.read_text()}\n--- job log ---\n{output}"  # fmt: skip
    assert (state, exit_code) == ("COMPLETED", 0), f"{describe}\n{slurm_cluster.logs()}"
    assert "Restarts=0" in record.split(), describe
    assert "near its time limit" not in output and "0: ran to the end" in output, describe
