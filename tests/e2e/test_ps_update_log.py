"""A ps killed with SIGKILL loses no acknowledged step when it keeps an update log
(``ps/update_log.py``; ``tensorfleet launch --ps-update-log DIR`` sets
``TENSORFLEET_PS_UPDATE_LOG`` for the tasks): the CNN example on 1 ps + 2 workers under the
launcher's defaults (the warm spare ps takes over), the ps killed between two checkpoints;
the spare is restored from the newest checkpoint and replays the log, and comes back at a
global step no lower than the last one a worker printed (a step line is printed after its
push was acknowledged) before the kill. Training then runs to the end. The same with the ps
SIGSTOPped and never resumed: the launcher replaces it (``launch/stopped_ps.py``) and the
spare replays the log as after a kill. And ``tensorfleet launch`` with no update-log option:
its default log (a directory of the launch in ``/dev/shm``) brings a killed ps back the same
way, and is gone when the launch ends.

Synchronized through the launcher's output; no timing is asserted.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tensorfleet import environment
from tensorfleet.launch.local_cluster import LocalCluster
from tests.e2e.test_launcher import assert_all_gone
from tests.e2e.test_preemption_launch import DATA, EXAMPLE, STEP_LINE, WatchedOutput, run_beside

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data, pytest.mark.timeout(240)]

REPLAYED = re.compile(
    r"replayed (\d+) updates of the update log .* at global step (\d+), version \d+ "
    r"\(the checkpoint was at global step (\d+)\)"
)


@dataclass
class DisturbedRun:
    """What :func:`run_with_the_ps_disturbed` saw: the cluster, its output, its exit status,
    what the disturbing thread raised, and the global steps noted (``stopped_pid``,
    ``acknowledged``: the last step a worker printed before the signal; ``replayed_step``
    and ``checkpoint_step`` from the spare's replay line)."""

    cluster: LocalCluster
    output: WatchedOutput
    status: int
    failures: list[BaseException]
    seen: dict[str, int]
    log_dir: Path

    @property
    def text(self) -> str:
        return self.output.log.getvalue()


def run_with_the_ps_disturbed(tmp_path: Path, sig: signal.Signals) -> DisturbedRun:
    """The CNN example on 1 ps + 2 workers with the update log and a warm spare ps; ``sig``
    goes to the ps between the checkpoints at 25 and 50 (a SIGSTOP is never resumed here),
    and the run goes on until a worker is 5 steps past the spare's replay, then to its end."""
    command = [
        sys.executable, str(EXAMPLE), "--steps", "100", "--log-every", "1",
        "--train-limit", "3000", "--test-limit", "1000", "--logdir", str(tmp_path / "run"),
        "--checkpoint-steps", "25", "--summary-steps", "100000",
    ]  # fmt: skip
    output = WatchedOutput()
    log_dir = tmp_path / "update-log"
    env = {environment.PS_UPDATE_LOG_VAR: str(log_dir)}
    cluster = LocalCluster(1, 2, command, output=output, ps_spares=1, env=env)
    seen: dict[str, int] = {}

    def disturb_the_ps() -> None:
        # past the checkpoint at 25, before the one at 50
        at, _ = output.wait_for("worker:1", STEP_LINE, min_number=35)
        seen["stopped_pid"] = cluster.pids["ps:0"]
        cluster.kill_task("ps:0", sig)
        lines = output.lines()  # the lines printed so far: steps acknowledged
        seen["acknowledged"] = max(
            int(m.group(2))
            for task, text in lines
            if task.startswith("worker:") and (m := STEP_LINE.search(text))
        )
        at, replayed = output.wait_for("ps:0", REPLAYED, at, min_number=0)
        seen["replayed_step"] = int(replayed.group(2))
        seen["checkpoint_step"] = int(replayed.group(3))
        output.wait_for("worker:1", STEP_LINE, at, min_number=seen["replayed_step"] + 5)

    status, failures = run_beside(cluster, disturb_the_ps, 200)
    return DisturbedRun(cluster, output, status, failures, seen, log_dir)


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed (make data)")
def test_a_ps_killed_with_sigkill_comes_back_at_its_last_acknowledged_step(
    tmp_path: Path,
) -> None:
    run = run_with_the_ps_disturbed(tmp_path, signal.SIGKILL)
    cluster, seen, text = run.cluster, run.seen, run.text
    assert not run.failures, f"{run.failures[0]}\n{text}"
    assert run.status == 0, text
    assert cluster.restarts["ps:0"] == 1, text
    assert seen["checkpoint_step"] < seen["acknowledged"], text  # steps to bring back
    assert seen["replayed_step"] >= seen["acknowledged"], (seen, text)
    # the chief says so too, not only that it restored the checkpoint (a trial read its
    # "restoring checkpoint ... (global step N)" as N being where training went on from)
    assert (
        f"restored from the checkpoint of global step {seen['checkpoint_step']}, then replayed "
        f"its update log to global step {seen['replayed_step']}" in text
    ), text
    assert re.search(r"^\[worker:0\] Test accuracy: \d\.\d+", text, re.M), text
    assert list(run.log_dir.glob("ps-0.*.updatelog")), text
    pids = [pid for t in cluster.tasks for pid in [t.pid, *t.previous_pids] if pid is not None]
    assert_all_gone(pids, text)


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed (make data)")
def test_a_stopped_ps_is_replaced_and_the_update_log_keeps_every_step(tmp_path: Path) -> None:
    """The ps SIGSTOPped instead, never resumed: the launcher replaces it after 2 s
    (``launch/stopped_ps.py``, ``auto`` with the log) and the spare replays the log as after
    a kill."""
    run = run_with_the_ps_disturbed(tmp_path, signal.SIGSTOP)
    cluster, seen, text = run.cluster, run.seen, run.text
    assert not run.failures, f"{run.failures[0]}\n{text}"
    assert run.status == 0, text
    assert cluster.restarts["ps:0"] == 1, text
    pid = seen["stopped_pid"]
    assert re.search(
        rf"ps:0 \(pid {pid}\) has been stopped for [\d.]+ s .*nothing is lost", text
    ), text
    assert re.search(r"ps:0 was stopped for [\d.]+ s and killed by the launcher", text), text
    assert seen["checkpoint_step"] < seen["acknowledged"], text  # steps to bring back
    assert seen["replayed_step"] >= seen["acknowledged"], (seen, text)
    assert re.search(r"^\[worker:0\] Test accuracy: \d\.\d+", text, re.M), text
    pids = [pid for t in cluster.tasks for pid in [t.pid, *t.previous_pids] if pid is not None]
    assert_all_gone(pids, text)


LOG_LINE = re.compile(r"ps update log: (/\S+) \(a ps killed with SIGKILL comes back")
STARTED_PS = re.compile(r"started ps:0 as pid (\d+)")
PLAIN_STEP = re.compile(r"^\[worker:\d+\] Worker: \d+, Step: (\d+)")


class LauncherLines:
    """The lines of a ``tensorfleet launch`` process, read with a deadline each."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process, self.seen, self._rest = process, [], b""

    def next(self, deadline: float) -> str | None:
        """The next line (None at the end of the output)."""
        assert self.process.stdout is not None
        while b"\n" not in self._rest:
            left = deadline - time.monotonic()
            assert left > 0, "no line in time:\n" + "\n".join(self.seen)
            ready, _, _ = select.select([self.process.stdout], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                if not self._rest:
                    return None
                self._rest += b"\n"
            self._rest += chunk
        line, self._rest = self._rest.split(b"\n", 1)
        self.seen.append(line.decode(errors="replace"))
        return self.seen[-1]

    def until(self, pattern: re.Pattern[str], deadline: float) -> re.Match[str]:
        while (line := self.next(deadline)) is not None:
            if match := pattern.search(line):
                return match
        raise AssertionError(f"{pattern.pattern!r} never came:\n" + "\n".join(self.seen))

    @property
    def text(self) -> str:
        return "\n".join(self.seen)


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed (make data)")
def test_the_launchers_default_log_brings_a_killed_ps_back_and_is_gone_at_the_end(
    tmp_path: Path,
) -> None:
    command = [
        sys.executable, "-m", "tensorfleet", "launch", "--ps", "1", "--workers", "2",
        "--no-live", "--", sys.executable, str(EXAMPLE), "--steps", "100", "--log-every", "1",
        "--train-limit", "3000", "--test-limit", "1000", "--logdir", str(tmp_path / "run"),
        "--checkpoint-steps", "25", "--summary-steps", "100000",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != environment.PS_UPDATE_LOG_VAR}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    lines = LauncherLines(process)
    deadline = time.monotonic() + 200
    try:
        log_dir = Path(lines.until(LOG_LINE, deadline).group(1))
        assert log_dir.parent == Path("/dev/shm") and log_dir.is_dir(), lines.text
        ps_pid = int(lines.until(STARTED_PS, deadline).group(1))
        acknowledged = 0
        while acknowledged < 35:  # past the checkpoint at 25, before the one at 50
            acknowledged = max(acknowledged, int(lines.until(PLAIN_STEP, deadline).group(1)))
        os.kill(ps_pid, signal.SIGKILL)
        replayed = lines.until(REPLAYED, deadline)
        assert int(replayed.group(3)) < acknowledged <= int(replayed.group(2)), lines.text
        assert list(log_dir.glob("ps-0.*.updatelog")), lines.text
        while lines.next(deadline) is not None:
            pass
        assert process.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, lines.text
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert re.search(r"^\[worker:0\] Test accuracy: \d\.\d+", lines.text, re.M), lines.text
    assert not log_dir.exists(), lines.text  # removed with the launch
