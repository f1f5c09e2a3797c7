"""The launcher end to end: LocalCluster and ``tensorfleet launch`` with fake task programs.

The tasks are ``programs/fake_task.py`` (for workers, and for ps tasks via ``ps_command`` /
``--ps-command``), never the real parameter server. Tasks synchronize through their own
sockets (the ps tells each worker ``go`` once all are connected), tests through process exits
and lines read from pipes; nothing waits on a sleep. After every test, every process a task
reported (its pid, and any grandchild it left) must be gone.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from tensorfleet.errors import DeadlineExceeded, LaunchError
from tensorfleet.launch.cli import main
from tensorfleet.launch.local_cluster import LocalCluster
from tensorfleet.launch.output import Output, PlainOutput
from tensorfleet.launch.restart_policy import RestartPolicy
from tests.processes import process_alive

pytestmark = pytest.mark.e2e

FAKE = Path(__file__).parent / "programs" / "fake_task.py"
SHORT = {"grace_period": 1.0, "kill_timeout": 1.0}


@pytest.fixture(autouse=True)
def _fresh_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every task here starts fresh: the fake task imports nothing heavy, so a task fork
    server would cost its own imports of torch (seconds) and save nothing; the supervision
    these tests check is the same either way, and forked tasks have their own tests
    (tests/e2e/test_task_forks.py)."""
    monkeypatch.setenv("TENSORFLEET_TASK_FORKS", "0")


def fake(*args: str) -> list[str]:
    """argv of the fake task program with ``args``."""
    return [sys.executable, str(FAKE), *args]


def fake_cmdline(*args: str) -> str:
    """The same, as one command line (for ``--ps-command``)."""
    return subprocess.list2cmdline(fake(*args))


def task_infos(text: str) -> dict[str, dict]:
    """The ``TASK_INFO`` each task printed, by task name, from prefixed launcher output."""
    infos = {}
    for match in re.finditer(r"^\[(\w+:\d+)\] TASK_INFO (.*)$", text, re.MULTILINE):
        infos[match.group(1)] = json.loads(match.group(2))
    return infos


def reported_pids(text: str) -> list[int]:
    """Every pid the tasks printed: their own and their grandchildren's."""
    pids = [info["pid"] for info in task_infos(text).values()]
    pids += [int(m) for m in re.findall(r"GRANDCHILD (\d+)", text)]
    return pids


def assert_all_gone(pids: Iterable[int], context: str, timeout: float = 5.0) -> None:
    """Every process in ``pids`` exits within ``timeout`` (SIGKILL is delivered
    asynchronously), waiting on pidfds rather than polling where the kernel has them."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            try:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
            finally:
                os.close(fd)
        assert not process_alive(pid), (
            f"process {pid} is still running after the launcher\n{context}"
        )


@pytest.fixture
def log() -> io.StringIO:
    return io.StringIO()


def plain(log: io.StringIO) -> PlainOutput:
    """One stream for task lines and launcher messages, in order."""
    return PlainOutput(log, log)


# ---------------------------------------------------------------- LocalCluster from Python


def test_every_task_gets_prefixed_output_and_its_environment(log: io.StringIO) -> None:
    lc = LocalCluster(
        1,
        2,
        fake("--connect", "--lines", "3"),
        ps_command=fake("--serve"),
        output=plain(log),
        **SHORT,
    )
    with lc:
        status = lc.wait(timeout=10)
    text = log.getvalue()
    assert status == 0, text
    assert_all_gone(reported_pids(text), text)

    names = ["ps:0", "worker:0", "worker:1"]
    for name in names:
        for i in range(3 if name.startswith("worker") else 2):
            assert f"[{name}] line {i} of {name}\n" in text, text
        assert f"[{name}] stderr line of {name}\n" in text, text  # stderr is merged
        assert lc.recent_lines(name)[-1] == f"last words of {name}", text
    assert "[ps:0] training over" in text, text

    infos = task_infos(text)
    assert sorted(infos) == names, text
    ports = set()
    for name, info in infos.items():
        job, index = name.split(":")
        assert info["tf_config"] == {
            "cluster": lc.cluster,
            "task": {"type": job, "index": int(index)},
        }, text
        assert info["secret"] == lc.secret, text
        assert info["launcher"] == "1" and info["unbuffered"] == "1", text
        assert info["pid"] == lc.pids[name], text
    started = ", ".join(f"{name} as pid {infos[name]['pid']}" for name in names)  # start order
    assert f"started {started}" in text, text  # each task's pid, to signal or watch it
    for address in lc.cluster["ps"] + lc.cluster["worker"]:
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1", lc.cluster
        ports.add(port)
    assert len(ports) == 3, lc.cluster
    assert re.fullmatch(r"[0-9a-f]{64}", lc.secret)
    assert lc.returncodes == {name: 0 for name in names}, text
    # The ps exited on its own: nothing is reported about it.
    assert "warning" not in text and "error" not in text, text


def test_no_ps_tasks_for_allreduce(log: io.StringIO) -> None:
    with LocalCluster(0, 2, fake(), output=plain(log), **SHORT) as lc:
        status = lc.wait(timeout=10)
    text = log.getvalue()
    assert status == 0, text
    assert lc.cluster["ps"] == [] and len(lc.cluster["worker"]) == 2
    assert all(info["tf_config"]["cluster"]["ps"] == [] for info in task_infos(text).values())
    assert_all_gone(reported_pids(text), text)


@pytest.mark.parametrize(
    ("ps_args", "signal_seen", "expected_warning"),
    [
        (("--hang", "ps:*"), signal.SIGTERM, "stopping it with SIGTERM"),
        (("--hang", "ps:*", "--ignore-sigterm", "ps:*"), signal.SIGKILL, "killing it with SIGKILL"),
    ],
    ids=["sigterm", "sigkill"],
)
def test_ps_that_never_exits_is_stopped_after_the_grace_period(
    log: io.StringIO, ps_args: tuple[str, ...], signal_seen: int, expected_warning: str
) -> None:
    lc = LocalCluster(1, 1, fake(), ps_command=fake(*ps_args), output=plain(log), **SHORT)
    with lc:
        status = lc.wait(timeout=10)
    text = log.getvalue()
    assert status == 0, text  # the workers succeeded; a stuck ps is a warning, not a failure
    assert lc.returncodes == {"ps:0": -signal_seen, "worker:0": 0}, text
    assert re.search(r"warning: ps:0 did not exit within 1 s after all workers finished", text)
    assert expected_warning in text, text
    assert_all_gone(reported_pids(text), text)


def test_ps_is_stopped_at_once_when_every_worker_failed(log: io.StringIO) -> None:
    # Both workers exit 2 at once (a typo in their flags); the ps would wait forever. The
    # grace period is far longer than wait()'s bound: only stopping the ps at once, rather
    # than after the grace period, ends the run within that bound.
    lc = LocalCluster(
        1,
        2,
        fake("--exit", "worker:*=2"),
        ps_command=fake("--hang", "*"),
        output=plain(log),
        grace_period=600.0,
        kill_timeout=5.0,
    )
    with lc:
        status = lc.wait(timeout=60)
    text = log.getvalue()
    lines = text.splitlines()
    assert status == 2, text
    assert lc.returncodes == {"ps:0": -signal.SIGTERM, "worker:0": 2, "worker:1": 2}, text
    stop = [i for i, ln in enumerate(lines) if "no worker is left running: stopping ps:0 now" in ln]
    assert len(stop) == 1, text
    failed = [i for i, ln in enumerate(lines) if re.search(r"worker:\d (also )?failed", ln)]
    assert len(failed) == 2 and max(failed) < stop[0], text  # after the last worker's end
    assert "stopping ps:0 with SIGTERM" in "\n".join(lines[stop[0] :]), text
    # A grace period is announced, if at all, only to tasks that had not ended yet.
    for i, line in enumerate(lines):
        if "giving " in line and " up to 600 s" in line:
            for name in line.split("giving ", 1)[1].split(" up to")[0].split(", "):
                ended = [
                    j
                    for j, ln in enumerate(lines)
                    if re.search(rf"{name} (ended|(also )?failed)", ln)
                ]
                assert ended and min(ended) > i, f"{name} had ended before line {i}\n{text}"
    assert "did not exit within" not in text, text
    assert_all_gone(lc.pids.values(), text)


def test_ps_is_stopped_at_once_when_the_last_worker_left_only_waits_for_a_restart(
    log: io.StringIO,
) -> None:
    # worker:0 dies as if killed (status 137): its restart waits out a long back-off;
    # worker:1 fails. The failure cancels the pending restart, so no worker is left and the
    # ps must be stopped at once: the grace period is far longer than wait()'s bound (the
    # restart's cancellation used to come after the check, which then waited it out).
    lc = LocalCluster(
        1,
        2,
        fake("--exit", "worker:0=137", "--exit", "worker:1=2"),
        ps_command=fake("--hang", "*"),
        output=plain(log),
        grace_period=600.0,
        kill_timeout=5.0,
        restart_policy=RestartPolicy(backoff_s=300.0, max_backoff_s=300.0),
    )
    with lc:
        status = lc.wait(timeout=60)
    text = log.getvalue()
    assert status != 0, text
    assert "no worker is left running: stopping ps:0 now" in text, text
    assert lc.returncodes["ps:0"] == -signal.SIGTERM, text
    assert_all_gone(lc.pids.values(), text)


def test_wait_deadline_then_stop(log: io.StringIO) -> None:
    lc = LocalCluster(1, 1, fake("--hang", "*"), ps_command=fake("--hang", "*"), output=plain(log))
    with lc:
        with pytest.raises(DeadlineExceeded, match="still running"):
            lc.wait(timeout=0.3)
        assert lc.result is None
        status = lc.stop()
    text = log.getvalue()
    assert status == 128 + signal.SIGTERM, text
    assert lc.returncodes == {"ps:0": -signal.SIGTERM, "worker:0": -signal.SIGTERM}, text
    assert lc.stop() == status  # idempotent
    assert_all_gone(lc.pids.values(), text)


def test_leftover_grandchild_is_killed(log: io.StringIO) -> None:
    lc = LocalCluster(0, 1, fake("--grandchild", "worker:0"), output=plain(log), **SHORT)
    with lc:
        status = lc.wait(timeout=10)
    text = log.getvalue()
    assert status == 0, text
    assert "GRANDCHILD" in text, text
    assert "worker:0 left processes behind in its process group" in text, text
    assert_all_gone(reported_pids(text), text)


def test_invalid_arguments() -> None:
    with pytest.raises(LaunchError, match="workers must be >= 1"):
        LocalCluster(1, 0, fake())
    with pytest.raises(LaunchError, match="ps tasks must be >= 0"):
        LocalCluster(-1, 1, fake())
    with pytest.raises(LaunchError, match="shlex.split"):
        LocalCluster(0, 1, "python train.py")  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="empty"):
        LocalCluster(0, 1, [])
    with pytest.raises(LaunchError, match="call start"):
        LocalCluster(0, 1, fake(), output=Output()).wait()


def test_missing_program_stops_the_started_tasks(log: io.StringIO) -> None:
    lc = LocalCluster(
        1, 1, ["/nonexistent/program"], ps_command=fake("--hang", "*"), output=plain(log), **SHORT
    )
    with pytest.raises(LaunchError, match="cannot start worker:0"):
        lc.start()
    assert lc.returncodes["ps:0"] is not None, log.getvalue()  # stopped and reaped
    assert_all_gone(lc.pids.values(), log.getvalue())


# ---------------------------------------------------------------- the command line


def launch_argv(*options: str) -> list[str]:
    return [sys.executable, "-m", "tensorfleet", "launch", "--no-live", *options]


def run_launcher(argv: list[str], timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )


@pytest.mark.parametrize("ps_mode", ["--ps-command", "--ps-runs-script"])
def test_cli_success(ps_mode: str) -> None:
    if ps_mode == "--ps-command":
        options = ["--ps-command", fake_cmdline("--serve"), "--", *fake("--connect")]
    else:  # TensorFlow style: one script for every task, branching on its job
        options = ["--ps-runs-script", "--", *fake("--serve", "--connect")]
    argv = launch_argv("--ps", "1", "--workers", "2", "--grace-period", "2", *options)
    result = run_launcher(argv)
    text = result.stdout
    assert result.returncode == 0, text
    assert sorted(task_infos(text)) == ["ps:0", "worker:0", "worker:1"], text
    for name in ("ps:0", "worker:0", "worker:1"):
        assert f"[{name}] last words of {name}" in text, text
    assert "warning" not in text and "error" not in text, text
    assert "[launcher] all 2 worker(s) finished" in text, text
    assert_all_gone(reported_pids(text), text)


def test_cli_failing_worker_is_reported_and_the_others_are_stopped() -> None:
    argv = launch_argv(
        "--ps", "1", "--workers", "3", "--grace-period", "1", "--kill-timeout", "1",
        "--ps-command", fake_cmdline("--serve"),
        "--", *fake("--connect", "--exit", "worker:1=3", "--hang", "worker:0",
                    "--hang", "worker:2"),
    )  # fmt: skip
    result = run_launcher(argv)
    text = result.stdout
    assert result.returncode == 3, text
    assert "[launcher] error: worker:1 failed with exit code 3" in text, text
    # The report repeats the failed task's last lines, its very last one included.
    report = text[text.index("worker:1 failed") :]
    assert "[worker:1] last words of worker:1" in report, text
    assert "stopping ps:0, worker:0, worker:2 with SIGTERM" in text, text
    assert len(task_infos(text)) == 4, text
    assert_all_gone(reported_pids(text), text)


def test_cli_sigterm_stops_every_task() -> None:
    argv = launch_argv(
        "--ps", "1", "--workers", "2", "--kill-timeout", "1",
        "--ps-command", fake_cmdline("--serve"),
        "--", *fake("--connect", "--hang", "*"),
    )  # fmt: skip
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        assert launcher.stdout is not None
        waiting = {"READY worker:0", "READY worker:1"}
        for line in launcher.stdout:  # bounded by the test's timeout
            seen.append(line)
            waiting.discard(line.partition("] ")[2].strip())
            if not waiting:
                break
        assert not waiting, "".join(seen)
        launcher.send_signal(signal.SIGTERM)
        rest, _ = launcher.communicate(timeout=10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(5)
    text = "".join(seen) + rest
    assert launcher.returncode == 128 + signal.SIGTERM, text
    assert "received SIGTERM: stopping every task" in text, text
    assert len(task_infos(text)) == 3, text
    assert_all_gone(reported_pids(text), text)


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch"]) == 2
    assert "tensorfleet: error: no command to run" in capsys.readouterr().err
    assert main(["launch", "--no-live", "--workers", "0", "--", "python", "x.py"]) == 2
    assert "tensorfleet: error: the number of workers must be >= 1" in capsys.readouterr().err
    assert main(["launch", "--ps-runs-script", "--ps-command", "x", "--", "python"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    argv = ["launch", "--no-live", "--ps", "0", "--workers", "1", "--", "/nonexistent/program"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "tensorfleet: error: cannot start worker:0" in err and "Traceback" not in err, err
    assert main([]) == 2


def test_cli_options_of_the_program_before_the_separator(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["launch", "--ps", "1", "--workers", "2", "--steps", "100", "--", "python", "x.py"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: tensorfleet launch" in err, err  # the launch command's usage, not the top's
    assert "tensorfleet launch: error: unrecognized arguments: --steps." in err, err
    assert "the worker program's options go after `--`" in err, err
    assert main(["server", "--steps", "100"]) == 2  # other commands: argparse's own message
    assert "tensorfleet: error: unrecognized arguments: --steps 100" in capsys.readouterr().err


def test_cli_negative_grace_period_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--no-live", "--grace-period", "-3", "--", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "tensorfleet: error: --grace-period (grace_period) must be >= 0 seconds, got -3" in err
    assert main(["launch", "--no-live", "--kill-timeout", "0", "--", "python", "x.py"]) == 2
    assert "--kill-timeout (kill_timeout) must be > 0 seconds, got 0" in capsys.readouterr().err


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    from tensorfleet import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tensorfleet {__version__}"
