"""Warm spare workers end to end: a worker killed with SIGKILL is taken over by the spare the
launcher kept waiting in ``resolve_task``; a command that cannot wait as a spare turns spares
off and the run goes on; nothing is left running.

The tasks run :data:`PROGRAM`, which prints a line before ``resolve_task`` (a spare's early
line, shown under the prefix of the task it becomes), then what it became. Tests synchronize
through the launcher's output and ``wait_spare_ready``; none asserts a timing.
"""

from __future__ import annotations

import io
import re
import signal
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tensorfleet.launch.local_cluster import LocalCluster
from tensorfleet.launch.restart_policy import RestartPolicy
from tests.e2e.test_launcher import SHORT, assert_all_gone, launch_argv, run_launcher
from tests.e2e.test_launcher_restarts import PROGRAM as RESTARTS_PROGRAM
from tests.e2e.test_launcher_restarts import HookedOutput, all_pids, runs_of
from tests.e2e.test_preemption_launch import FIRST_RESTART

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

#: argv: MARKER_DIR. Prints ``EARLY <pid>``, resolves its task, leaves the marker that it got to
#: work (``task_markers.SERVING``: the launcher starts its spares then), counts its runs in
#: MARKER_DIR, prints ``RUN {json}``. worker:1's first run says ``READY worker:1`` and waits to
#: be killed; worker:0 (the chief) waits until worker:1 has run twice, so that the run is not
#: complete (a worker killed after that would be retired, not restarted); then both exit 0.
PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from tensorfleet import task_markers
    from tensorfleet.cluster.resolver import resolve_task

    marker_dir = Path(sys.argv[1])
    print(f"EARLY {os.getpid()}", flush=True)
    task = resolve_task(argv=[])
    name = f"{task.job}:{task.index}"
    task_markers.mark_serving(name)  # at work: the launcher starts its spares now
    marker = marker_dir / (name.replace(":", "-") + ".runs")
    with marker.open("a") as f:
        f.write("x")
    run = len(marker.read_text())
    print("RUN " + json.dumps({
        "run": run, "pid": os.getpid(), "tf_config": json.loads(os.environ["TF_CONFIG"]),
        "secret": os.environ.get("TENSORFLEET_SECRET"),
        "dead": os.environ.get("TENSORFLEET_PREDECESSOR_DEAD"),
        "spare_var": os.environ.get("TENSORFLEET_SPARE_PIPE"),
    }), flush=True)
    deadline = time.monotonic() + 60
    if name == "worker:1" and run == 1:
        print("READY worker:1", flush=True)
        time.sleep(60)
        sys.exit(9)  # never killed: the test failed; exit anyway
    if name == "worker:0":
        other = marker_dir / "worker-1.runs"
        while time.monotonic() < deadline and (not other.exists() or len(other.read_text()) < 2):
            time.sleep(0.05)
    print(f"done {name}", flush=True)
    """
)


@pytest.fixture
def log() -> io.StringIO:
    return io.StringIO()


#: Leaves the marker that the task got to work (``task_markers.SERVING``: the launcher starts
#: its spares then); reads TF_CONFIG itself, so a spare (without it) fails here at once.
MARK_SERVING = textwrap.dedent(
    """
    import json, os
    from tensorfleet import task_markers
    _task = json.loads(os.environ["TF_CONFIG"])["task"]
    task_markers.mark_serving(f"{_task['type']}:{_task['index']}")
    """
)
#: Prints ``up`` and the spare's pipe (None for a task); a task first leaves the marker that
#: it got to work, so the launcher starts its spares before it handles the task's exit.
QUICK = (
    "import os\n"
    "if 'TF_CONFIG' in os.environ:\n" + textwrap.indent(MARK_SERVING, "    ") + "\n"
    "print('up', os.environ.get('TENSORFLEET_SPARE_PIPE'), flush=True)\n"
)


def spare_program(marker_dir: Path) -> list[str]:
    return [sys.executable, "-c", PROGRAM, str(marker_dir)]


def started_spares(text: str) -> dict[int, int]:
    """Spare number -> pid, from the launcher's ``started warm spare N ... as pid P`` lines."""
    return {
        int(m.group(1)): int(m.group(2))
        for m in re.finditer(r"started warm spare (\d+) for the workers as pid (\d+)", text)
    }


def test_a_killed_worker_is_taken_over_by_the_warm_spare(log: io.StringIO, tmp_path: Path) -> None:
    ready = threading.Event()
    output = HookedOutput(log, on_line=lambda task, text: text == "READY worker:1" and ready.set())
    lc = LocalCluster(0, 2, spare_program(tmp_path), output=output, spares=1, **SHORT)
    with lc:
        assert ready.wait(30), log.getvalue()
        spare_pid = lc.wait_spare_ready(30)
        assert spare_pid is not None, log.getvalue()
        assert lc.pids.keys() == {"worker:0", "worker:1"}  # a spare is not a task
        lc.kill_task("worker:1", signal.SIGKILL)
        status = lc.wait(timeout=60)
    text = log.getvalue()
    assert status == 0, text
    spares = started_spares(text)
    assert spares[1] == spare_pid and 2 in spares, text  # a new spare behind the used one
    assert re.search(
        rf"restarted worker:1 \({FIRST_RESTART}\) as pid {spare_pid}: warm spare 1, started "
        r"[\d.]+ s ago and waiting",
        text,
    ), text
    first, second = runs_of(text)["worker:1"]
    assert second["pid"] == spare_pid and first["pid"] != spare_pid, text
    assert second["tf_config"] == first["tf_config"] and second["secret"] == first["secret"]
    assert (first["dead"], second["dead"], second["spare_var"]) == (None, "1", None), text
    # its line from before resolve_task, under the prefix of the task it became
    assert f"[worker:1] EARLY {spare_pid}" in text, text
    assert "[spare" not in text and "warm spare waiting for an identity" not in text, text
    assert_all_gone([*all_pids(text), *spares.values()], text)


def test_a_command_that_cannot_wait_as_a_spare_turns_spares_off(
    log: io.StringIO, tmp_path: Path
) -> None:
    # This program reads TF_CONFIG itself: as a spare (no TF_CONFIG) it fails at once.
    command = [sys.executable, "-c", MARK_SERVING + RESTARTS_PROGRAM, str(tmp_path)]
    ready = threading.Event()
    output = HookedOutput(log, on_line=lambda task, text: text == "READY worker:1" and ready.set())
    off = threading.Event()
    output.on_message = lambda text: "warm spares are off" in text and off.set()
    lc = LocalCluster(
        0,
        2,
        [*command, "worker:1", "hang-once"],
        output=output,
        spares=1,
        restart_policy=RestartPolicy(crash_loop_s=0.0),
        **SHORT,
    )
    statuses: list[int] = []
    with lc:
        # the launcher learns of the spare's exit while it supervises
        supervisor = threading.Thread(target=lambda: statuses.append(lc.wait(timeout=60)))
        supervisor.start()
        assert ready.wait(30) and off.wait(30), log.getvalue()
        lc.kill_task("worker:1")
        supervisor.join(60)
    status = statuses[0] if statuses else None
    text = log.getvalue()
    assert status == 0, text
    assert re.search(
        r"warm spares are off for this run: warm spare 1 \(pid \d+\) ended with exit code 1 "
        r"after [\d.]+ s before it waited for an identity: the worker command must call "
        r"tensorfleet.resolve_task\(\)",
        text,
    ), text
    assert "[spare 1] KeyError: 'TF_CONFIG'" in text and "warning: warm spares" not in text, text
    assert re.search(
        rf"restarted worker:1 \({FIRST_RESTART}\) as pid \d+\n",
        text,
    ), text
    assert [r["run"] for r in runs_of(text)["worker:1"]] == [1, 2], text
    assert_all_gone([*all_pids(text), *started_spares(text).values()], text)


def test_the_launcher_keeps_one_spare_by_default_and_none_with_spares_0(tmp_path: Path) -> None:
    spares: list[int] = []
    for flags, expected in (((), 1), (("--spares", "0"), 0)):
        argv = launch_argv(
            "--ps", "0", "--workers", "1", *flags, "--", sys.executable, "-c", QUICK
        )  # fmt: skip
        result = run_launcher(argv, timeout=40)
        text = result.stdout
        assert result.returncode == 0, text
        assert len(started_spares(text)) == expected, text
        assert "[worker:0] up None" in text, text  # the task itself is no spare
        spares += started_spares(text).values()
    assert_all_gone(spares, "spares of the runs above")


def test_spares_with_the_ray_backend_are_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tensorfleet.launch.cli import main

    status = main(["launch", "--backend", "ray", "--spares", "1", "--", sys.executable, "x.py"])
    err = capsys.readouterr().err
    assert status != 0
    assert "--spares 1: warm spares need the local backend, not --backend ray" in err, err


#: argv: GO_FILE. Resolves its task and prints ``UP``; waits for GO_FILE, then leaves the
#: marker that it got to work and prints ``AT WORK``; waits for GO_FILE.end and exits 0 (each
#: wait at most a minute).
AT_WORK_PROGRAM = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tensorfleet import task_markers
    from tensorfleet.cluster.resolver import resolve_task

    task = resolve_task(argv=[])
    print("UP", flush=True)
    go = Path(sys.argv[1])
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    task_markers.mark_serving(f"{task.job}:{task.index}")
    print("AT WORK", flush=True)
    end = go.with_suffix(".end")
    while not end.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


def test_the_spare_starts_once_a_task_is_at_work_not_at_launch(
    log: io.StringIO, tmp_path: Path
) -> None:
    up = threading.Event()
    output = HookedOutput(log, on_line=lambda task, text: text == "UP" and up.set())
    go = tmp_path / "go"
    command = [sys.executable, "-c", AT_WORK_PROGRAM, str(go)]
    lc = LocalCluster(0, 1, command, output=output, spares=1, **SHORT)
    with lc:
        assert up.wait(30), log.getvalue()
        task_pid = lc.pids["worker:0"]
        # the task runs, but has not got to work: no spare, however often the launcher looks
        assert lc.wait_spare_ready(1.0) is None, log.getvalue()
        assert lc.spare_pids == [] and not started_spares(log.getvalue()), log.getvalue()
        go.touch()
        spare_pid = lc.wait_spare_ready(30)
        assert spare_pid is not None, log.getvalue()
        go.with_suffix(".end").touch()
        status = lc.wait(timeout=60)
    text = log.getvalue()
    assert status == 0, text
    assert "[worker:0] AT WORK" in text and started_spares(text) == {1: spare_pid}, text
    assert_all_gone([task_pid, spare_pid], text)
