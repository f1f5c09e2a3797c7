"""A task that got to work before it was killed is no crash loop (``task_markers.SERVING``):
the launcher restarts it at once, however short its run, instead of waiting the crash-loop
back-off; one that did not waits it as before. Synchronized through the launcher's output;
no timing is asserted."""

from __future__ import annotations

import io
import re
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tensorfleet.launch.local_cluster import LocalCluster
from tests.e2e.test_launcher import SHORT, assert_all_gone
from tests.e2e.test_launcher_restarts import HookedOutput, all_pids, runs_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

#: argv: MARKER_DIR SERVE. Prints ``RUN {json}``; worker:1's first run leaves the serving
#: marker when SERVE is "serve" (as a ps does once its shard has variables, a worker after its
#: first step), says ``READY worker:1`` and waits to be killed. Every other run exits 0.
PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from tensorfleet import task_markers

    marker_dir, serve = Path(sys.argv[1]), sys.argv[2] == "serve"
    config = json.loads(os.environ["TF_CONFIG"])
    name = f"{config['task']['type']}:{config['task']['index']}"
    marker = marker_dir / (name.replace(":", "-") + ".runs")
    with marker.open("a") as f:
        f.write("x")
    run = len(marker.read_text())
    print("RUN " + json.dumps({"run": run, "pid": os.getpid()}), flush=True)
    if name == "worker:1" and run == 1:
        if serve:
            task_markers.mark_serving(name)
        print("READY worker:1", flush=True)
        time.sleep(60)
        sys.exit(9)  # never killed: the test failed; exit anyway
    print(f"done {name}", flush=True)
    """
)


@pytest.mark.parametrize("served", [True, False], ids=["got-to-work", "did-not"])
def test_a_task_killed_after_it_got_to_work_is_restarted_at_once(
    served: bool, tmp_path: Path
) -> None:
    log = io.StringIO()
    ready = threading.Event()
    output = HookedOutput(log, on_line=lambda task, text: text == "READY worker:1" and ready.set())
    argv = [sys.executable, "-c", PROGRAM, str(tmp_path), "serve" if served else "no"]
    lc = LocalCluster(0, 2, argv, output=output, **SHORT)  # the default policy: 30 s threshold
    with lc:
        assert ready.wait(30), log.getvalue()
        lc.kill_task("worker:1")  # well under the 30 s threshold after its start
        status = lc.wait(timeout=40)
    text = log.getvalue()
    assert status == 0, text
    assert lc.restarts["worker:1"] == 1, text
    restart = re.search(r"worker:1 failed with signal SIGKILL; restarting it .*", text)
    assert restart is not None, text
    if served:
        assert re.search(
            r"\(restart 1 of 10\) at once \(it ran \d+\.\d s, under the crash-loop threshold "
            r"of 30 s, but got to work first: no crash loop\)",
            restart.group(0),
        ), text
    else:
        assert "in 1 s (crash-loop back-off: it ran" in restart.group(0), text
    assert [r["run"] for r in runs_of(text)["worker:1"]] == [1, 2], text
    assert_all_gone(all_pids(text), text)
