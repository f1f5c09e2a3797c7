"""A preempted worker's restart starts as soon as the worker has left, while its old process
still ends (``launch/preempted_handover.py``), with a small task program.

:data:`PROGRAM` plays a preempted worker: on SIGTERM it leaves ``task_markers.LEFT`` with its
pid, as a preempted ``TrainingSession`` does once its push is applied and its shards were
told, and then plays the interpreter's teardown: it does not end before its restarted
process is up (a file that process writes; 30 s at most, then exit 3 and the test fails).
The launcher could only restart it at its exit before, so these tests fail without the
handover. :data:`SPARE_PROGRAM` does the same from a warm spare, preempted twice. Nothing
waits on a sleep in the tests, and no test asserts a timing.
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
from tests.e2e.test_launcher import SHORT, assert_all_gone
from tests.e2e.test_launcher_restarts import HookedOutput, all_pids, runs_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

#: argv: DIRECTORY MODE. Prints ``RUN {json}`` (run number, pid). A restarted process
#: (``TENSORFLEET_PREDECESSOR_DEAD=1``) writes DIRECTORY/restarted and exits 0. A first one
#: says it got to work (``task_markers.SERVING``: no crash-loop back-off), prints ``READY``
#: and waits for SIGTERM; then, by MODE: ``exit`` leaves LEFT, waits for its restart and
#: exits 143; ``crash`` the same but exits 1; ``hang`` leaves LEFT and never ends by itself;
#: ``stale`` leaves a LEFT marker with another pid (an earlier process's) and exits 143 at once.
PROGRAM = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from pathlib import Path
    from tensorfleet import task_markers

    directory, mode = Path(sys.argv[1]), sys.argv[2]
    config = json.loads(os.environ["TF_CONFIG"])
    name = f"{config['task']['type']}:{config['task']['index']}"
    runs = directory / "runs"
    with runs.open("a") as f:
        f.write("x")
    print("RUN " + json.dumps({"run": len(runs.read_text()), "pid": os.getpid()}), flush=True)
    if os.environ.get("TENSORFLEET_PREDECESSOR_DEAD"):
        print("restarted process up", flush=True)
        (directory / "restarted").write_text(str(os.getpid()))
        sys.exit(0)
    preempted = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: preempted.set())
    task_markers.mark_serving(name)
    print(f"READY {name}", flush=True)
    if not preempted.wait(30):
        sys.exit(9)
    if mode == "stale":
        task_markers.mark(task_markers.LEFT, name, text=str(os.getpid() + 1))
        print("left a stale marker; exiting", flush=True)
        sys.exit(143)
    task_markers.mark_left(name)
    print("left", flush=True)
    deadline = time.monotonic() + (60 if mode == "hang" else 30)
    while not (directory / "restarted").exists() or mode == "hang":
        if time.monotonic() > deadline:
            print("no restart while this process was still ending", flush=True)
            sys.exit(3)
        time.sleep(0.05)
    print("old process ends", flush=True)
    sys.exit(1 if mode == "crash" else 143)
    """
)


def run_preempted(tmp_path: Path, mode: str) -> tuple[int, str, LocalCluster]:
    """One worker running :data:`PROGRAM` in ``mode``, SIGTERMed once it is ready: the run's
    status, its log, and the cluster."""
    log = io.StringIO()
    ready = threading.Event()
    output = HookedOutput(log, on_line=lambda task, text: text == "READY worker:0" and ready.set())
    command = [sys.executable, "-c", PROGRAM, str(tmp_path), mode]
    cluster = LocalCluster(0, 1, command, output=output, **SHORT)
    with cluster:
        assert ready.wait(30), log.getvalue()
        cluster.kill_task("worker:0", signal.SIGTERM)
        status = cluster.wait(timeout=45)
    text = log.getvalue()
    assert_all_gone(all_pids(text), text)
    return status, text, cluster


def test_a_preempted_worker_is_restarted_once_it_left_while_its_old_process_still_ends(
    tmp_path: Path,
) -> None:
    status, text, cluster = run_preempted(tmp_path, "exit")
    assert status == 0, text
    assert cluster.restarts == {"worker:0": 1}, text
    first, second = (run["pid"] for run in runs_of(text)["worker:0"])
    assert re.search(
        rf"worker:0 left the cluster \(preempted: its last push applied; pid {first} ends its "
        r"interpreter meanwhile, SIGKILL if it has not within 1 s\); restarting it \(not "
        r"counted: preempted, it left cleanly after \d+\.\d s; 0 of 10 used\) at once "
        r"\(preempted: no crash loop\)",
        text,
    ), text
    # the old process ended only once its restart was up (it waits for the file the restart
    # writes): the restart ran while the old process still ended
    assert "[worker:0] old process ends" in text, text
    assert "no restart while this process was still ending" not in text, text
    assert re.search(rf"worker:0's preempted process \(pid {first}\) exited 143, ", text), text
    assert re.search(rf"restarted worker:0 \(not counted: .*\) as pid {second}", text), text
    assert "failed with exit code 143" not in text, text


def test_a_worker_that_left_and_then_fails_to_end_cleanly_is_reported_not_failed(
    tmp_path: Path,
) -> None:
    status, text, _ = run_preempted(tmp_path, "crash")
    assert status == 0, text  # it had left: its restart carries the task
    first = runs_of(text)["worker:0"][0]["pid"]
    assert re.search(
        rf"worker:0's preempted process \(pid {first}\) ended with exit code 1 [\d.]+ s after it "
        r"left, not with the 143 of a preemption; its restart already runs",
        text,
    ), text


def test_a_worker_that_left_and_never_ends_is_killed_after_the_kill_timeout(
    tmp_path: Path,
) -> None:
    status, text, _ = run_preempted(tmp_path, "hang")
    assert status == 0, text
    first = runs_of(text)["worker:0"][0]["pid"]
    assert (
        f"worker:0's preempted process (pid {first}) did not exit within 1 s after it left; "
        "killing it with SIGKILL" in text
    ), text
    assert f"worker:0's preempted process (pid {first}) ended (signal SIGKILL) once killed" in text
    assert "no restart while this process was still ending" not in text, text


def test_a_left_marker_of_another_process_is_ignored(tmp_path: Path) -> None:
    status, text, cluster = run_preempted(tmp_path, "stale")
    assert status == 0, text
    assert cluster.restarts == {"worker:0": 1}, text
    assert "worker:0 failed with exit code 143; restarting it" in text, text
    assert "left the cluster" not in text, text


#: argv: DIRECTORY. A worker for a run with a warm spare: it waits in ``tfl.resolve_task()``
#: (a spare, until the launcher hands it an identity), counts its run in DIRECTORY/runs,
#: prints ``RUN {json}`` and ``READY worker:0 run N``. Runs 1 and 2 wait for SIGTERM, leave
#: ``task_markers.LEFT`` and do not end before the next run is up (DIRECTORY/up-<N+1>; 30 s
#: at most, then exit 3), then exit 143; run 3 exits 0.
SPARE_PROGRAM = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from pathlib import Path
    import tensorfleet as tfl
    from tensorfleet import task_markers

    directory = Path(sys.argv[1])
    preempted = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: preempted.set())
    task = tfl.resolve_task()
    name = f"{task.job}:{task.index}"
    runs = directory / "runs"
    with runs.open("a") as f:
        f.write("x")
    run = len(runs.read_text())
    print("RUN " + json.dumps({"run": run, "pid": os.getpid()}), flush=True)
    task_markers.mark_serving(name)
    print(f"READY {name} run {run}", flush=True)
    (directory / f"up-{run}").write_text("")
    if run >= 3:
        sys.exit(0)
    if not preempted.wait(30):
        sys.exit(9)
    task_markers.mark_left(name)
    deadline = time.monotonic() + 30
    while not (directory / f"up-{run + 1}").exists():
        if time.monotonic() > deadline:
            print("no restart while this process was still ending", flush=True)
            sys.exit(3)
        time.sleep(0.05)
    sys.exit(143)
    """
)


def test_a_warm_spare_that_took_over_and_is_preempted_is_handed_over_too(tmp_path: Path) -> None:
    """The second preemption hits a process that was a warm spare: its exit arrives as a
    spare's, and is still that of a process that left, not the task's."""
    log = io.StringIO()
    ready = {1: threading.Event(), 2: threading.Event()}

    def on_line(task: str, text: str) -> None:
        match = re.fullmatch(r"READY worker:0 run (\d)", text)
        if task == "worker:0" and match and int(match.group(1)) in ready:
            ready[int(match.group(1))].set()

    command = [sys.executable, "-c", SPARE_PROGRAM, str(tmp_path)]
    cluster = LocalCluster(
        0, 1, command, output=HookedOutput(log, on_line=on_line), spares=1, **SHORT
    )
    failures: list[str] = []

    def preempt_twice() -> None:
        for run in (1, 2):
            if not ready[run].wait(30) or cluster.wait_spare_ready(30) is None:
                failures.append(f"run {run} or a spare to take it over never got ready")
                return
            cluster.kill_task("worker:0", signal.SIGTERM)

    driver = threading.Thread(target=preempt_twice, daemon=True)
    with cluster:
        driver.start()
        status = cluster.wait(timeout=50)
        driver.join(30)
    text = log.getvalue()
    assert not failures, f"{failures}\n{text}"
    assert status == 0, text
    assert cluster.restarts == {"worker:0": 2}, text
    pids = [run["pid"] for run in runs_of(text)["worker:0"]]
    assert len(pids) == 3, text
    assert len(re.findall(r"worker:0 left the cluster \(preempted", text)) == 2, text
    assert re.search(rf"restarted worker:0 \(not counted: .*\) as pid {pids[1]}: warm spare", text)
    # clean preemptions never count toward the signal-restart limit (restart_policy.py)
    assert "restart 1 of 10" not in text, text
    for pid in pids[:2]:  # the second one was a spare: its exit came as a spare's
        assert re.search(rf"worker:0's preempted process \(pid {pid}\) exited 143, ", text), text
    assert "no restart while this process was still ending" not in text, text
    assert_all_gone(pids, text)
