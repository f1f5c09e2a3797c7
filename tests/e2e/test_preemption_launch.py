"""SIGTERM (a preemption) to the ps and then to the chief of the CNN example under the
launcher's default settings (``session/preemption.py``, ``ps/preemption_drain.py``).

The ps asks the chief for a checkpoint, exits with status 143 once it is written, is
restarted, and the chief restores it from that checkpoint: at the very global step the ps had
reached, so no step is lost (periodic checkpoints are off, so no other checkpoint exists).
Then the chief, preempted, writes a checkpoint at the end of its step, exits with 143 and is
restarted. The run completes with exit status 0 and the accuracy line.
"""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tensorfleet.launch.local_cluster import LocalCluster
from tensorfleet.launch.output import PlainOutput

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist_cnn.py"
DATA = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
#: Room after the chief's preemption (about 20 steps after the ps's) for its restart to make
#: steps of its own before worker:1 alone reaches the end: a chief that restarts after the
#: end writes no summary, and the example's plot of the run's metrics then fails (150 left
#: too little once the ps is preempted only after its warm spare waits).
LAST_STEP = 220
WAIT_S = 120.0
STEP_LINE = re.compile(r"^Worker: (\d+), Step: (\d+)")
PS_PREEMPTED = re.compile(r"parameter service ended \(preempted\) at global step (\d+)")
RESTORING = re.compile(r"restoring checkpoint \S+ \(global step (\d+)\)")
CHIEF_PREEMPTED = re.compile(
    r"worker:0: preempted \(SIGTERM\) at global step (\d+); checkpoint saved"
)


class WatchedOutput(PlainOutput):
    """The plain log, and a way to wait for the first line of a task that matches a pattern."""

    def __init__(self) -> None:
        self.log = io.StringIO()
        super().__init__(self.log, self.log)
        self._lines: list[tuple[str, str]] = []
        self._changed = threading.Condition()

    def line(self, task: str, text: str) -> None:
        super().line(task, text)
        with self._changed:
            self._lines.append((task, text))
            self._changed.notify_all()

    def lines(self) -> list[tuple[str, str]]:
        """Every ``(task, line)`` printed so far, in order."""
        with self._changed:
            return list(self._lines)

    def wait_for(
        self, task: str, pattern: re.Pattern[str], after: int = 0, min_number: int = 0
    ) -> tuple[int, re.Match]:
        """The index and match of the first line of ``task`` from ``after`` on that matches
        ``pattern`` with its last group's number at least ``min_number``."""
        with self._changed:
            found = None

            def seen() -> bool:
                nonlocal found
                for index in range(after, len(self._lines)):
                    name, text = self._lines[index]
                    match = pattern.search(text) if name == task else None
                    if match and int(match.groups()[-1]) >= min_number:
                        found = (index, match)
                        return True
                return False

            if not self._changed.wait_for(seen, WAIT_S):
                raise AssertionError(
                    f"no line of {task} matched {pattern.pattern!r} within {WAIT_S} s\n"
                    + self.log.getvalue()
                )
            assert found is not None
            return found


#: How the launcher's lines count a task's first restart: ``restart 1 of 10``, or, for a
#: process that worked 30 s or more before it died (a slow machine),
#: ``not counted: it worked 41.3 s; 0 of 10 used`` (``launch/restart_policy.py``).
FIRST_RESTART = r"(?:restart 1 of 10|not counted: it worked [\d.]+ s; 0 of 10 used)"


def run_beside(
    cluster: LocalCluster, drive: Callable[[], None], timeout_s: float
) -> tuple[int, list[BaseException]]:
    """Start ``cluster``, run ``drive`` on a thread beside its supervision (``cluster.wait``,
    which restarts the tasks ``drive`` disturbs), and stop everything: the exit status and
    what ``drive`` raised (an empty list: nothing)."""
    failures: list[BaseException] = []

    def guarded() -> None:
        try:
            drive()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            failures.append(exc)

    driver = threading.Thread(target=guarded, daemon=True)
    try:
        cluster.start()
        driver.start()
        status = cluster.wait(timeout=timeout_s)
        driver.join(WAIT_S)
    finally:
        cluster.stop()
    return status, failures


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed (make data)")
@pytest.mark.parametrize("ps_spares", [0, 1], ids=["new-ps-process", "warm-spare-ps"])
def test_a_preempted_ps_and_chief_save_first_and_lose_no_step(
    tmp_path: Path, ps_spares: int
) -> None:
    """With a new ps process, or with the warm spare ps that ``tensorfleet launch`` keeps by
    default taking the preempted ps's identity: the restore is at the very step it reached."""
    command = [
        sys.executable, str(EXAMPLE), "--steps", str(LAST_STEP), "--log-every", "1",
        "--train-limit", "3000", "--test-limit", "1000", "--logdir", str(tmp_path / "run"),
        "--checkpoint-steps", "100000", "--summary-steps", "100000",
    ]  # fmt: skip
    output = WatchedOutput()
    # the launcher's defaults otherwise
    cluster = LocalCluster(1, 2, command, output=output, ps_spares=ps_spares)
    seen: dict[str, int] = {}

    def preempt_the_ps_then_the_chief() -> None:
        """Runs beside the supervision (``cluster.wait``), which restarts the tasks."""
        # the spare starts once the run is at work: the preempted ps must find it waiting
        if ps_spares and cluster.wait_spare_ready(WAIT_S, job="ps") is None:
            raise AssertionError("no ps spare waited for an identity")
        at, _ = output.wait_for("worker:1", STEP_LINE, min_number=20)
        os.kill(cluster.pids["ps:0"], signal.SIGTERM)
        at, preempted = output.wait_for("ps:0", PS_PREEMPTED, at)
        seen["ps_step"] = int(preempted.group(1))
        at, restored = output.wait_for("worker:0", RESTORING, at)
        seen["restored_step"] = int(restored.group(1))
        at, _ = output.wait_for("worker:1", STEP_LINE, at, min_number=seen["ps_step"] + 20)
        os.kill(cluster.pids["worker:0"], signal.SIGTERM)
        _, chief = output.wait_for("worker:0", CHIEF_PREEMPTED, at)
        seen["chief_step"] = int(chief.group(1))

    status, failures = run_beside(cluster, preempt_the_ps_then_the_chief, 240)
    text = output.log.getvalue()
    assert not failures, f"{failures[0]}\n{text}"
    assert seen["restored_step"] == seen["ps_step"], f"{seen}\n{text}"  # no step lost
    assert seen["chief_step"] > seen["ps_step"], f"{seen}\n{text}"
    assert status == 0, text
    assert cluster.restarts == {"ps:0": 1, "worker:0": 1, "worker:1": 0}, text
    took_the_spare = re.search(rf"restarted ps:0 \({FIRST_RESTART}\) as pid \d+: warm spare", text)
    assert bool(took_the_spare) == bool(ps_spares), text
    assert re.search(r"^\[worker:0\] Test accuracy: \d\.\d+", text, re.M), text
    assert text.count("restoring checkpoint") == 1, "the restarted chief adopts the live ps"
