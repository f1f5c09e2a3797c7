"""The launcher's end-of-run summary names every task's peak memory (``launch/peak_memory.py``):
each task leaves its peak RSS when it exits (``tensorfleet.task_memory``), a task killed
by SIGKILL leaves none and shows ``?``.

The tasks run :data:`PROGRAM`: each records its peak at exit; worker:1 first touches 200 MiB,
so its peak is the largest; ps:0 exits 0 at once, worker:0 too.
"""

from __future__ import annotations

import io
import re
import sys
import textwrap
from pathlib import Path

import pytest

from tensorfleet.launch.local_cluster import LocalCluster
from tests.e2e.test_launcher import SHORT
from tests.e2e.test_launcher_restarts import HookedOutput

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

PROGRAM = textwrap.dedent(
    """
    import json, os
    from tensorfleet import task_memory

    config = json.loads(os.environ["TF_CONFIG"])
    name = f"{config['task']['type']}:{config['task']['index']}"
    task_memory.record_at_exit(name)
    if name == "worker:1":
        block = bytearray(200 << 20)  # zero-filled: every page touched
        print("touched", len(block), flush=True)
    """
)


def _mib(text: str, task: str) -> float:
    match = re.search(rf"{re.escape(task)} ([0-9.]+) (MiB|GiB)", text)
    assert match is not None, text
    return float(match.group(1)) * (1024 if match.group(2) == "GiB" else 1)


def test_the_summary_lists_each_tasks_peak_rss(tmp_path: Path) -> None:
    log = io.StringIO()
    output = HookedOutput(log, lambda task, text: None, lambda text: None)
    command = [sys.executable, "-c", PROGRAM]
    lc = LocalCluster(1, 2, command, ps_command=command, output=output, **SHORT)
    try:
        lc.start()
        status = lc.wait(timeout=50)
    finally:
        lc.stop()
    text = log.getvalue()
    assert status == 0, text
    line = next((x for x in text.splitlines() if "peak memory (RSS):" in x), None)
    assert line is not None, text
    assert _mib(line, "worker:1") >= 200, line
    assert _mib(line, "worker:1") > _mib(line, "ps:0") + 150, line
    assert _mib(line, "worker:0") > 1, line
