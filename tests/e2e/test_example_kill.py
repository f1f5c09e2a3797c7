"""``kill -9`` of a worker of the CNN example under the launcher's default settings.

The default restart policy restarts a task killed by a signal: the run completes with the
accuracy line and exit status 0, and the restarted worker makes global steps again. The
seconds from its restart to its first step are printed (reported, never asserted). The log
also carries the chief's progress lines, which must hold no control characters.
"""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tensorfleet.launch.local_cluster import LocalCluster
from tensorfleet.launch.output import PlainOutput
from tensorfleet.session.progress_report import parse_progress_line

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist_cnn.py"
DATA = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
LAST_STEP = 400
STEP_LINE = re.compile(r"^Worker: (\d+), Step: (\d+)")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class TimedOutput(PlainOutput):
    """The plain log (as CI gets it), plus when each task line and message arrived."""

    def __init__(self) -> None:
        self.log = io.StringIO()
        super().__init__(self.log, self.log)
        self.events: list[tuple[float, str, str]] = []
        self.stepped = threading.Event()

    def line(self, task: str, text: str) -> None:
        super().line(task, text)
        self.events.append((time.monotonic(), task, text))
        if task == "worker:1" and STEP_LINE.match(text):
            self.stepped.set()

    def message(self, text: str, level: str = "info") -> None:
        super().message(text, level)
        self.events.append((time.monotonic(), "launcher", text))


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed (make data)")
def test_kill_9_of_a_worker_under_the_default_launcher(tmp_path: Path) -> None:
    command = [
        sys.executable, str(EXAMPLE), "--steps", str(LAST_STEP), "--log-every", "1",
        "--train-limit", "3000", "--test-limit", "1000", "--progress-secs", "2",
    ]  # fmt: skip
    output = TimedOutput()
    cluster = LocalCluster(1, 3, command, output=output)  # the launcher's defaults
    try:
        cluster.start()
        assert output.stepped.wait(120), output.log.getvalue()
        killed_pid = cluster.pids["worker:1"]
        os.kill(killed_pid, signal.SIGKILL)  # kill -9 of the process, as the OOM killer does
        status = cluster.wait(timeout=240)
    finally:
        cluster.stop()
    text = output.log.getvalue()
    assert status == 0, text
    assert cluster.restarts == {"ps:0": 0, "worker:0": 0, "worker:1": 1, "worker:2": 0}, text
    assert re.search(r"^\[worker:0\] Test accuracy: \d\.\d+", text, re.M), text

    restarted_at = next(
        t for t, task, text in output.events if text.startswith("restarted worker:1")
    )
    steps_after = [
        (t, int(m.group(2)))
        for t, task, line in output.events
        if task == "worker:1" and t > restarted_at and (m := STEP_LINE.match(line))
    ]
    assert steps_after, f"the restarted worker made no step\n{text}"
    print(
        f"restarted worker:1 made its first step (global step {steps_after[0][1]}) "
        f"{steps_after[0][0] - restarted_at:.1f} s after its restart; {len(steps_after)} steps "
        "after the restart in all"
    )

    progress = [r for line in text.splitlines() if (r := parse_progress_line(line))]
    assert progress and all(r.last_step == LAST_STEP for r in progress), text
    assert all(
        line.startswith("[worker:0] [progress]")
        for line in text.splitlines()
        if "[progress]" in line
    )
    assert not CONTROL.search(text.replace("\n", "")), "control characters in the log"
