"""tensorfleet slurm: the sbatch script's directives, its environment, the secret kept in a
file, the requeue near the time limit (run with stand-ins for srun and scontrol), and bad
input refused before anything is written. The real Slurm run is in tests/clusters_real."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tensorfleet.cluster.resolver import resolve_task
from tensorfleet.errors import AuthenticationError, ClusterConfigError
from tensorfleet.launch.cli import main
from tensorfleet.launch.renderers.secret_file import ensure_secret_file
from tensorfleet.launch.renderers.shape import ClusterShape
from tensorfleet.launch.renderers.slurm import SbatchOptions, render_sbatch

pytestmark = pytest.mark.timeout(60)


def options(tmp_path: Path, **kwargs) -> SbatchOptions:
    values = {
        "shape": ClusterShape(1, 3),
        "command": ["python", "train.py", "--steps", "3000"],
        "secret_file": tmp_path / "secret",
    }
    values.update(kwargs)
    return SbatchOptions(**values)


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]  # fmt: skip


def test_directives_for_a_cluster_shape(tmp_path):
    script = render_sbatch(
        options(
            tmp_path,
            shape=ClusterShape(2, 6),
            nodes=4,
            tasks_per_node=2,
            gpus_per_task=1,
            cpus_per_task=8,
            time="2:00:00",
            partition="gpu",
        )
    )
    assert directives(script) == [
        "--job-name=tensorfleet",
        "--ntasks=8",
        "--nodes=4",
        "--ntasks-per-node=2",
        "--gpus-per-task=1",
        "--cpus-per-task=8",
        "--time=2:00:00",
        "--partition=gpu",
        "--output=tensorfleet-%j.out",
        "--distribution=block",
        "--requeue",
        "--signal=B:USR1@120",
    ]
    assert "export TENSORFLEET_SLURM_NUM_PS=2\n" in script
    assert "export TENSORFLEET_SLURM_NUM_WORKERS=6\n" in script
    assert "srun --kill-on-bad-exit=1 --label python train.py --steps 3000 &\n" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_no_requeue_runs_srun_in_the_foreground(tmp_path):
    script = render_sbatch(options(tmp_path, requeue=False, overcommit=True))
    assert "--no-requeue" in directives(script) and "--overcommit" in directives(script)
    assert not any(d.startswith("--signal") for d in directives(script))
    assert "trap" not in script
    assert script.endswith("srun --kill-on-bad-exit=1 --label python train.py --steps 3000\n")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_the_secret_is_a_file_path_never_a_value(tmp_path):
    path, secret = ensure_secret_file(tmp_path / "secret")
    script = render_sbatch(options(tmp_path, secret_file=path))
    assert f"export TENSORFLEET_SECRET_FILE={path}\n" in script
    assert "unset TENSORFLEET_SECRET TF_CONFIG\n" in script
    assert secret.decode() not in script
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_ensure_secret_file_refuses_a_file_others_can_read(tmp_path):
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123")
    path.chmod(0o644)
    with pytest.raises(AuthenticationError, match=re.escape(f"run `chmod 600 {path}`")):
        ensure_secret_file(path)
    path.chmod(0o600)
    assert ensure_secret_file(path) == (path, b"0123456789abcdef0123")


def write_stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def test_usr1_requeues_the_job_and_the_script_exits_with_the_steps_status(tmp_path):
    """The script under stand-ins: srun records its environment and waits to be released;
    USR1 (what Slurm sends near the time limit) makes the script call scontrol requeue; the
    script still waits for the step and exits with its status."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started, release, calls = tmp_path / "started", tmp_path / "release", tmp_path / "scontrol"
    write_stub(
        bin_dir / "srun",
        f"env > {started}.tmp && mv {started}.tmp {started}\n"
        f"for i in $(seq 600); do [ -e {release} ] && exit 3; sleep 0.05; done; exit 99\n",
    )
    write_stub(bin_dir / "scontrol", f'echo "$@" >> {calls}; touch {release}\n')
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(options(tmp_path, time="10")))
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "TF_CONFIG": '{"stale": true}',
        "TENSORFLEET_SECRET": "must-not-reach-the-tasks",
    }
    process = subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the stand-in srun never started"
            time.sleep(0.05)
        process.send_signal(signal.SIGUSR1)
        assert process.wait(timeout=30) == 3
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert calls.read_text() == "requeue 4242\n"
    assert "job 4242 is near its time limit: requeueing it" in process.stderr.read()
    seen = dict(line.split("=", 1) for line in started.read_text().splitlines() if "=" in line)
    assert seen["TENSORFLEET_SLURM_NUM_PS"] == "1" and seen["TENSORFLEET_SLURM_NUM_WORKERS"] == "3"
    assert seen["TENSORFLEET_SECRET_FILE"] == str(tmp_path / "secret")
    assert "TF_CONFIG" not in seen and "TENSORFLEET_SECRET" not in seen


def test_the_script_environment_resolves_every_rank(tmp_path):
    """What the script exports plus what srun sets: each rank finds its task."""
    exported = {
        "TENSORFLEET_SLURM_NUM_PS": "1",
        "TENSORFLEET_SLURM_NUM_WORKERS": "3",
        "TENSORFLEET_SLURM_BASE_PORT": "2222",
    }
    assert all(f"export {k}={v}\n" in render_sbatch(options(tmp_path)) for k, v in exported.items())
    srun = {"SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    tasks = [
        str(resolve_task(argv=[], environ={**exported, **srun, "SLURM_PROCID": str(r)}).task_id)
        for r in range(4)
    ]
    assert tasks == ["ps:0", "worker:0", "worker:1", "worker:2"]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (
            {"nodes": 2, "tasks_per_node": 1},
            "the allocation is smaller than the cluster shape: --nodes 2 x --tasks-per-node 1 = "
            "2 tasks, but 1 ps + 3 workers = 4 tasks",
        ),
        ({"nodes": 5}, "--nodes 5 is more than the 4 tasks of 1 ps + 3 workers"),
        ({"gpus_per_task": 0}, "--gpus-per-task must be a positive integer, got 0"),
        ({"time": "2h"}, "--time '2h' is not a Slurm time limit"),
        ({"partition": "gpu; rm -rf /"}, "--partition 'gpu; rm -rf /' may hold only"),
        ({"base_port": 65534}, "--base-port 65534 with up to 4 tasks per node"),
        ({"signal_seconds": -1}, "--signal-seconds must be 0 (no signal) or positive, got -1"),
        ({"command": []}, "no command to run"),
    ],
)
def test_bad_options_are_refused(tmp_path, kwargs, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        options(tmp_path, **kwargs)


def test_cli_writes_the_script_and_creates_the_secret_file(tmp_path, capsys):
    script, secret = tmp_path / "job.sbatch", tmp_path / "secret"
    argv = ["slurm", "--ps", "1", "--workers", "3", "--time", "30", "--secret-file", str(secret)]
    assert main([*argv, "-o", str(script), "--", "python", "train.py"]) == 0
    assert capsys.readouterr().out.strip() == str(script)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert f"export TENSORFLEET_SECRET_FILE={secret}\n" in script.read_text()


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--ps", "0", "--workers", "0"], "the cluster shape has 0 tasks"),
        (["--workers", "3", "--nodes", "1", "--tasks-per-node", "2"], "allocation is smaller"),
        ([], "no secret file: give --secret-file PATH"),
    ],
)
def test_cli_refuses_bad_input_before_writing(tmp_path, capsys, monkeypatch, argv, fragment):
    monkeypatch.delenv("TENSORFLEET_SECRET_FILE", raising=False)
    secret = [] if not argv else ["--secret-file", str(tmp_path / "secret")]
    out = tmp_path / "job.sbatch"
    assert main(["slurm", *argv, *secret, "-o", str(out), "--", "python", "t.py"]) == 2
    assert fragment in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "secret").exists()
