"""The chaos run's dumps of silent workers (benchmarks/silent_worker_dumps.py): a process
silent past the threshold is dumped once, with its Python stack; one still stepping is not."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from silent_worker_dumps import SilentWorkerDumps  # noqa: E402

SLEEPER = "import time\ndef waits_for_a_reply():\n    time.sleep(120)\nwaits_for_a_reply()\n"


@pytest.mark.timeout(90)
def test_a_silent_worker_is_dumped_once_with_its_stack_and_a_busy_one_is_not() -> None:
    dumps = SilentWorkerDumps(silent_s=5.0, every_s=0.1)
    assert dumps.spy is not None, "py-spy is in the test extras (pyproject.toml)"
    silent = subprocess.Popen([sys.executable, "-c", SLEEPER])
    busy = subprocess.Popen([sys.executable, "-c", SLEEPER])
    try:
        time.sleep(1.0)  # the sleepers reach their function
        dumps.start(lambda: {"worker:1": (silent.pid, 30.0), "worker:2": (busy.pid, 1.0)})
        deadline = time.monotonic() + 60
        while not dumps.dumps and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # further rounds: no second dump of the same process within REDUMP_S
        dumps.stop()
    finally:
        for process in (silent, busy):
            process.kill()
            process.wait()
    assert [(d["task"], d["pid"]) for d in dumps.dumps] == [("worker:1", silent.pid)]
    assert any("waits_for_a_reply" in line for line in dumps.dumps[0]["lines"]), dumps.dumps
