"""tensorfleet slurm: the sbatch script's directives, its environment, the secret kept in a
file, the requeue near the time limit (run with stand-ins for srun and scontrol), and bad
input refused before anything is written. The real Slurm run is in tests/clusters_real."""

from __future__ import annotations

import logging
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
from tensorfleet.launch.renderers.slurm import SbatchOptions, render_sbatch, time_limit_seconds

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
    srun = "srun --kill-on-bad-exit=1 --label --cpus-per-task=8 python train.py --steps 3000 &\n"
    assert srun in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@pytest.mark.parametrize("requeue", [True, False])
def test_cpus_per_task_is_on_the_srun_line(tmp_path, requeue):
    """Slurm >= 22.05: srun no longer takes --cpus-per-task from the job (only from its own
    flag or SRUN_CPUS_PER_TASK), so without it on the srun line each task gets 1 CPU."""
    script = render_sbatch(options(tmp_path, cpus_per_task=4, requeue=requeue))
    assert "--cpus-per-task=4" in directives(script)
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    assert srun.startswith("srun --kill-on-bad-exit=1 --label --cpus-per-task=4 python train.py")
    plain = render_sbatch(options(tmp_path, requeue=requeue))
    assert "--cpus-per-task" not in plain


@pytest.mark.parametrize(
    ("limit", "seconds"),
    [
        ("2", 120),
        ("90", 5400),
        ("1:30", 120),  # MM:SS; Slurm rounds seconds up to the next minute
        ("2:00:00", 7200),
        ("1-0", 86400),
        ("1-2:30", 95400),
        ("1-0:0:1", 86460),
        ("0", None),  # no limit
        ("UNLIMITED", None),
    ],
)
def test_time_limit_seconds(limit, seconds):
    assert time_limit_seconds(limit) == seconds


def signal_directives(script: str) -> list[str]:
    return [d for d in directives(script) if d.startswith("--signal")]


def test_the_default_signal_shrinks_to_fit_a_short_time_limit_and_says_so(tmp_path, caplog):
    """The tryout's job: --time 2 with the default signal at 120 s was requeued one second
    after it started, forever. The default now fits the limit, or is left out, and a note
    (logged as a warning) says so; a long enough limit keeps 120 s silently."""
    caplog.set_level(logging.WARNING, logger="tensorfleet.launch.renderers.slurm")
    roomy = options(tmp_path, time="10")
    assert (roomy.signal_at, roomy.notes) == (120, ())
    assert signal_directives(render_sbatch(roomy)) == ["--signal=B:USR1@120"]
    assert options(tmp_path).signal_at == 120  # no --time: the partition's limit, unknown

    three = options(tmp_path, time="3")
    assert three.signal_at == 30  # 180 s: half is 90, less the 60 s Slurm may signal early
    assert signal_directives(render_sbatch(three)) == ["--signal=B:USR1@30"]
    (note,) = three.notes
    assert "the requeue signal comes 30 s before the time limit, not the default 120 s" in note

    two = options(tmp_path, time="2")
    script = render_sbatch(two)
    assert two.signal_at == 0 and signal_directives(script) == [] and "trap" not in script
    (note,) = two.notes
    assert note.startswith("no requeue signal: --time 2 is too short for one")
    assert "Give a --time of at least 3 minutes" in note
    logged = [r.getMessage() for r in caplog.records]
    assert f"tensorfleet slurm: {note}" in logged


@pytest.mark.parametrize(
    ("time_limit", "asked", "fragment"),
    [
        ("2", 120, "--signal-seconds 120 does not leave the job time to run with --time 2"),
        ("2", 1, "Give a --time of at least 3 minutes, or --signal-seconds 0"),
        ("10", 300, "Give --signal-seconds 240 or less, a longer --time, or --signal-seconds 0"),
    ],
)
def test_an_explicit_signal_that_leaves_no_time_to_run_is_refused(
    tmp_path, time_limit, asked, fragment
):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        options(tmp_path, time=time_limit, signal_seconds=asked)


def test_the_time_a_refused_signal_asks_for_fits_that_signal(tmp_path):
    """The fix names a --time long enough for the signal asked: 120 s needs 6 minutes (the
    message said 3, which fits a 1-second signal only); that --time then takes it."""
    with pytest.raises(ClusterConfigError, match="Give a --time of at least 6 minutes"):
        options(tmp_path, time="2", signal_seconds=120)
    assert options(tmp_path, time="6", signal_seconds=120).signal_at == 120


def test_an_explicit_signal_that_fits_is_written_as_asked(tmp_path):
    fits = options(tmp_path, time="10", signal_seconds=240)
    assert (fits.signal_at, fits.notes) == (240, ())
    assert options(tmp_path, time="2", signal_seconds=0).signal_at == 0
    unused = options(tmp_path, time="2", signal_seconds=120, requeue=False)
    assert unused.signal_at == 0  # --no-requeue: no signal is written at all, and it says so
    assert unused.notes == (
        "--signal-seconds 120 is not used: with --no-requeue the script has no requeue signal "
        "(drop one of the two)",
    )


def test_gpus_per_task_says_the_ps_tasks_take_gpus_too(tmp_path):
    with_ps = options(tmp_path, gpus_per_task=1)
    assert any("4 GPUs in all, 1 of them for the ps" in note for note in with_ps.notes)
    assert options(tmp_path, shape=ClusterShape(0, 3), gpus_per_task=1).notes == ()


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


def test_ensure_secret_file_creates_missing_directories_with_mode_700(tmp_path, caplog):
    """The doc's own example, --secret-file ~/.tensorfleet/secret on a fresh account: the
    directory is created (mode 700, even under a permissive umask), and a warning says so."""
    caplog.set_level(logging.WARNING, logger="tensorfleet.launch.renderers.secret_file")
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home_mode = home.stat().st_mode
    target = home / ".tensorfleet" / "deeper" / "secret"
    old_umask = os.umask(0o022)
    try:
        path, secret = ensure_secret_file(target)
    finally:
        os.umask(old_umask)
    assert path == target and len(secret) >= 16
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    for directory in (home / ".tensorfleet", home / ".tensorfleet" / "deeper"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert f"created the directory {directory} (mode 700)" in caplog.text
    assert home.stat().st_mode == home_mode  # an existing directory is left as it was


def test_cli_creates_the_secret_files_directory_under_a_fresh_home(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    script = tmp_path / "job.sbatch"
    argv = ["slurm", "--secret-file", "~/.tensorfleet/secret", "-o", str(script)]
    assert main([*argv, "--", "python", "train.py"]) == 0, capsys.readouterr().err
    secret = tmp_path / "home" / ".tensorfleet" / "secret"
    assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
    assert f"export TENSORFLEET_SECRET_FILE={secret}\n" in script.read_text()


def test_a_secret_directory_that_cannot_be_made_is_refused_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(
        AuthenticationError, match=re.escape(f"cannot create its directory {blocker}")
    ):
        ensure_secret_file(blocker / "sub" / "secret")


def write_stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("step_ends_during_the_requeue", [False, True])
def test_usr1_requeues_the_job_and_the_script_exits_with_the_steps_status(
    tmp_path, step_ends_during_the_requeue
):
    """The script under stand-ins: srun records its environment and waits to be released;
    USR1 (what Slurm sends near the time limit) makes the script call scontrol requeue; the
    script still waits for the step and exits with its status. Also when the step ends while
    the requeue runs, before the interrupted wait is taken up again (seen on a loaded
    machine: the script exited with 138, the status of the interrupted wait)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started, release, calls = tmp_path / "started", tmp_path / "release", tmp_path / "scontrol"
    ended = tmp_path / "ended"
    write_stub(
        bin_dir / "srun",
        f"env > {started}.tmp && mv {started}.tmp {started}\n"
        f"for i in $(seq 600); do [ -e {release} ] && {{ echo $$ > {ended}; exit 3; }}; "
        "sleep 0.05; done; exit 99\n",
    )
    # The requeue returns only once the step has ended and the script has reaped it (its pid,
    # a zombie until then, answers kill -0): bounded, 30 s each.
    after_release = (
        f"for i in $(seq 600); do [ -s {ended} ] && break; sleep 0.05; done\n"
        f'for i in $(seq 600); do kill -0 "$(cat {ended})" 2>/dev/null || break; sleep 0.05; '
        "done\n"
        if step_ends_during_the_requeue
        else ""
    )
    write_stub(bin_dir / "scontrol", f'echo "$@" >> {calls}; touch {release}\n{after_release}')
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
        (
            {"signal_seconds": -1},
            "--signal-seconds must be 0 (no signal) or a number of seconds up to 65535 (Slurm's largest), got -1",
        ),
        ({"command": []}, "no command to run"),
    ],
)
def test_bad_options_are_refused(tmp_path, kwargs, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        options(tmp_path, **kwargs)


def test_cli_tryout_time_2_writes_no_signal_and_says_so(tmp_path, capsys, caplog):
    """`tensorfleet slurm --ps 0 --workers 1 --time 2 ... -- sleep 100`: no signal that would
    requeue the job as it starts; an explicit --signal-seconds 120 is refused (exit 2)."""
    caplog.set_level(logging.WARNING, logger="tensorfleet.launch.renderers.slurm")
    script, secret = tmp_path / "sig.sbatch", str(tmp_path / "secret")
    argv = ["slurm", "--ps", "0", "--workers", "1", "--time", "2", "--secret-file", secret]
    assert main([*argv, "-o", str(script), "--", "sleep", "100"]) == 0
    assert signal_directives(script.read_text()) == []
    assert "tensorfleet slurm: no requeue signal: --time 2 is too short" in caplog.text
    refused = tmp_path / "refused.sbatch"
    code = main([*argv, "--signal-seconds", "120", "-o", str(refused), "--", "sleep", "100"])
    assert code == 2 and not refused.exists()
    assert "--signal-seconds 120 does not leave the job time to run" in capsys.readouterr().err


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
