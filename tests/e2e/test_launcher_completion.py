"""A worker that ends after training is complete (the chief and every ps task exited 0) is
retired, not restarted, and does not fail the run (``launch/training_completion.py``).

The tasks run :data:`PROGRAM`: the ps and the chief wait for a release file the test
writes, then exit 0 (training complete); worker:1 waits until it is killed, on every run
(a restarted worker that finds no ps to answer it). Synchronization is through the output
the launcher's output object receives; no test asserts a timing.
"""

from __future__ import annotations

import io
import signal
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tensorfleet.launch.local_cluster import LocalCluster
from tests.e2e.test_launcher import SHORT, assert_all_gone
from tests.e2e.test_launcher_restarts import HookedOutput, all_pids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

#: argv: RELEASE_FILE [past-the-end]. ps:0 and worker:0 print READY and exit 0 once
#: RELEASE_FILE exists (polled, at most 50 s); worker:1 prints READY and hangs until it is
#: killed (at most 50 s); with ``past-the-end`` it first leaves the marker an all-reduce worker
#: leaves after its final barrier.
PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path

    release = Path(sys.argv[1])
    config = json.loads(os.environ["TF_CONFIG"])
    name = f"{config['task']['type']}:{config['task']['index']}"
    if sys.argv[2:] == ["past-the-end"] and name == "worker:1":
        from tensorfleet import task_markers  # what an all-reduce worker does after its barrier
        task_markers.mark(task_markers.COLLECTIVE_END, name)
    print("RUN " + json.dumps({"run": 0, "pid": os.getpid()}), flush=True)
    print(f"READY {name}", flush=True)
    deadline = time.monotonic() + 50
    while time.monotonic() < deadline:
        if name != "worker:1" and release.exists():
            print(f"done {name}", flush=True)
            sys.exit(0)
        time.sleep(0.05)
    sys.exit(9)  # never released nor killed: the test failed
    """
)


class Progress:
    """Events for the lines and messages the tests wait on."""

    def __init__(self) -> None:
        self.ready: dict[str, threading.Event] = {}
        self.runs: dict[str, int] = {}
        self.restarted = threading.Event()
        self.completed = threading.Event()
        self._lock = threading.Lock()

    def event(self, name: str) -> threading.Event:
        with self._lock:
            return self.ready.setdefault(name, threading.Event())

    def on_line(self, task: str, text: str) -> None:
        if text.startswith("READY "):
            with self._lock:
                self.runs[task] = self.runs.get(task, 0) + 1
                run = self.runs[task]
            self.event(f"{task}#{run}").set()  # "worker:1#2": its second run is ready
            self.event(task).set()

    def on_message(self, text: str) -> None:
        if text.startswith("restarted worker:1"):
            self.restarted.set()
        if text.startswith("worker:0 ended: exited 0"):
            self.completed.set()


def supervise(lc: LocalCluster, status: list[int]) -> threading.Thread:
    """Run ``lc.wait()`` in a thread (restarts and exits are handled inside it)."""
    thread = threading.Thread(target=lambda: status.append(lc.wait(timeout=50)), daemon=True)
    thread.start()
    return thread


def start_and_wait_until_ready(
    lc: LocalCluster,
    progress: Progress,
    log: io.StringIO,
    status: list[int],
    names: tuple[str, ...] = ("ps:0", "worker:0", "worker:1"),
) -> threading.Thread:
    """Start the cluster and its supervising thread; return once every task printed READY."""
    lc.start()
    supervisor = supervise(lc, status)
    for name in names:
        assert progress.event(name).wait(30), f"{name} never started:\n{log.getvalue()}"
    return supervisor


def cluster(
    tmp_path: Path, log: io.StringIO, progress: Progress, num_ps: int = 1, *extra: str
) -> LocalCluster:
    command = [sys.executable, "-c", PROGRAM, str(tmp_path / "release"), *extra]
    output = HookedOutput(log, progress.on_line, progress.on_message)
    return LocalCluster(num_ps, 2, command, ps_command=command, output=output, **SHORT)


def test_a_worker_killed_after_training_is_complete_is_not_restarted(tmp_path: Path) -> None:
    log, progress, status = io.StringIO(), Progress(), []
    lc = cluster(tmp_path, log, progress)
    try:
        supervisor = start_and_wait_until_ready(lc, progress, log, status)
        (tmp_path / "release").touch()
        assert progress.completed.wait(30), log.getvalue()
        lc.kill_task("worker:1", signal.SIGKILL)
        supervisor.join(50)
    finally:
        lc.stop()
    text = log.getvalue()
    assert status == [0], text
    assert "restarted worker:1" not in text, text
    assert "not restarting it, and not a failure: training was complete" in text, text
    assert "worker:1 ended after training was complete" in text, text
    assert_all_gone(all_pids(text), text)


def test_a_restarted_worker_still_waiting_when_training_completes_is_stopped(
    tmp_path: Path,
) -> None:
    """worker:1 is killed during training and restarted; its new run waits for a ps that
    will not answer. Training then completes: the launcher gives it the grace period, stops
    it with SIGTERM, and the run ends 0 (before, it ended with the worker's error)."""
    log, progress, status = io.StringIO(), Progress(), []
    lc = cluster(tmp_path, log, progress)
    try:
        supervisor = start_and_wait_until_ready(lc, progress, log, status)
        lc.kill_task("worker:1", signal.SIGKILL)
        assert progress.restarted.wait(30), log.getvalue()
        second_run = progress.event("worker:1#2")
        assert second_run.wait(30), log.getvalue()
        (tmp_path / "release").touch()
        supervisor.join(50)
    finally:
        lc.stop()
    text = log.getvalue()
    assert status == [0], text
    assert "training is complete (the chief and every ps task exited 0)" in text, text
    assert "stopping it with SIGTERM (training was complete)" in text, text
    assert text.count("restarted worker:1") == 1, text
    assert_all_gone(all_pids(text), text)


@pytest.mark.parametrize("past_the_end", [True, False], ids=["past-the-end", "in-training"])
def test_without_ps_a_worker_aborting_past_the_end_of_all_reduce_training_is_retired(
    tmp_path: Path, past_the_end: bool
) -> None:
    """No ps tasks; worker:0 exits 0, then worker:1 dies of SIGABRT (as torch's gloo backend
    can make a process die at interpreter exit). Past the end of all-reduce training (its
    marker) it is retired, not restarted (a restart could never rejoin the ended group: it
    waited 60 s and failed the run), and the run ends 0. Without the marker (any program,
    e.g. an actor) it is restarted, as before."""
    log, progress, status = io.StringIO(), Progress(), []
    extra = ("past-the-end",) if past_the_end else ()
    lc = cluster(tmp_path, log, progress, 0, *extra)
    try:
        supervisor = start_and_wait_until_ready(
            lc, progress, log, status, names=("worker:0", "worker:1")
        )
        (tmp_path / "release").touch()
        assert progress.completed.wait(30), log.getvalue()
        lc.kill_task("worker:1", signal.SIGABRT)
        if past_the_end:
            supervisor.join(50)
        else:
            assert progress.restarted.wait(30), log.getvalue()
    finally:
        lc.stop()
    text = log.getvalue()
    if past_the_end:
        assert status == [0], text
        assert "restarted worker:1" not in text, text
        assert "it had passed the final barrier of all-reduce training" in text, text
        assert "worker:1 ended after training was complete" in text, text
    assert_all_gone(all_pids(text), text)
