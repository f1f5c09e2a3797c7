"""The three device examples through `tensorfleet launch`, on Fashion-MNIST: in-graph
replication (2 workers x 2 CPU replicas), a pipeline in each task (2 stages), and two
pipelines of 2 stages across 4 worker tasks sharing the ps. Each prints its placement table
and trains (the loss falls below the untrained ln(10) = 2.30)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data, pytest.mark.timeout(200)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DATA = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


def launch(*options: str, example: str, steps: int = 60) -> str:
    """Run ``example`` under the launcher; its output. Without warm spares: no task is
    restarted here, and each spare (a worker's and a ps's, started once the run is at work)
    imports torch for nothing, a quarter of a launch's CPU seconds (18.5 -> 13.9 s measured);
    tests/e2e/test_warm_spares.py and test_ps_spare.py test the spares."""
    argv = [sys.executable, "-m", "tensorfleet", "launch", "--no-live", "--grace-period", "5",
            "--spares", "0", "--ps-spares", "0",
            *options, "--", sys.executable, str(EXAMPLES / example), "--steps", str(steps)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=170)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its tasks
        out, _ = proc.communicate(timeout=20)
        raise AssertionError(f"{example} did not finish in time:\n{out}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, out
    match = re.search(r"\[worker:0\] global step (\d+), loss ([\d.]+), test accuracy", out)
    assert match and int(match.group(1)) >= steps and float(match.group(2)) < 2.0, out
    return out


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed")
def test_in_graph_replication_trains_through_the_launcher():
    out = launch("--ps", "1", "--workers", "2", example="ingraph_replicas.py")
    assert re.search(r"\[worker:0\]\s+variable\s+1.weight\s+\[512, 784\]\s+ps:0\s+worker:0", out), (
        out
    )
    assert re.search(r"\[worker:0\]\s+module\s+1\s+Linear.*/device:CPU:0,/device:CPU:1", out), out


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed")
def test_pipeline_in_a_task_trains_through_the_launcher():
    out = launch("--ps", "1", "--workers", "2", example="pipeline_in_task.py")
    assert re.search(r"\[worker:0\]\s+module\s+1\s+Linear\s+-\s+worker:0\s+/device:CPU:0", out), out
    assert re.search(r"\[worker:0\]\s+module\s+7\s+Linear\s+-\s+worker:0\s+/device:CPU:1", out), out


@pytest.mark.skipif(not DATA.exists(), reason="Fashion-MNIST is not installed")
def test_pipelines_across_tasks_train_through_the_launcher():
    out = launch("--ps", "1", "--workers", "4", "--pipeline-stages", "2",
                 example="pipeline_across_tasks.py")  # fmt: skip
    assert re.search(r"\[worker:0\]\s+module\s+1\s+Linear\s+-\s+worker:0", out), out
    assert re.search(r"\[worker:0\]\s+module\s+7\s+Linear\s+-\s+worker:1", out), out
    for stage_task in ("worker:1", "worker:3"):
        assert re.search(rf"\[{stage_task}\] {stage_task} served stage 1 for \d+ steps", out), out


def test_pipeline_stages_must_divide_the_workers():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorfleet",
            "launch",
            "--no-live",
            "--workers",
            "3",
            "--pipeline-stages",
            "2",
            "--",
            sys.executable,
            "-c",
            "pass",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout
    assert "--workers 3 do not form whole pipelines of --pipeline-stages 2" in result.stdout
