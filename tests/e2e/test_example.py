"""The CNN example, end to end through the launcher, on a small slice of Fashion-MNIST."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import run_local_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.needs_data, pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist_cnn.py"
DATA = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")

needs_fashion_mnist = pytest.mark.skipif(
    not DATA.exists(),
    reason="Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist, as `make test` does when apt is usable)",
)


@needs_fashion_mnist
def test_example_converges_through_the_launcher(tmp_path):
    """300 async steps of 3 workers reach 0.70 test accuracy (after 200 steps, as it was, a
    run of the suite ended once at 0.689: the bar sat at the edge of the spread)."""
    logdir = tmp_path / "run"
    command = [
        sys.executable, str(EXAMPLE),
        "--steps", "300", "--log-every", "50", "--lr", "1e-3",
        "--train-limit", "6000", "--test-limit", "2000",
        "--logdir", str(logdir), "--checkpoint-steps", "100",
    ]  # fmt: skip
    run = run_local_cluster(1, 3, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    progress = [
        line
        for task in ("worker:0", "worker:1", "worker:2")
        for line in run.output.of(task)
        if line.startswith("Worker:")
    ]
    steps = sorted(int(re.search(r"Step: (\d+)", line).group(1)) for line in progress)
    assert steps == [50, 100, 150, 200, 250, 300], (
        f"one progress line per 50 global steps expected\n{run}"
    )
    chief_lines = run.output.of("worker:0")
    reports = [line for line in chief_lines if line.startswith("Test accuracy:")]
    assert reports, str(run)
    accuracy, global_step = re.match(
        r"Test accuracy: ([\d.]+) \(global step (\d+)", reports[0]
    ).groups()
    assert int(global_step) >= 300
    assert float(accuracy) >= 0.70, f"test accuracy {accuracy}\n{run}"
    others = run.output.of("worker:1") + run.output.of("worker:2")
    assert not any(line.startswith("Test accuracy:") for line in others), "only the chief evaluates"


@needs_fashion_mnist
def test_example_runs_as_one_process_without_a_cluster(tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import mnist_cnn
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    args = mnist_cnn.build_parser().parse_args(
        ["--steps", "10", "--train-limit", "1000", "--test-limit", "500", "--lr", "1e-3"]
    )
    result = mnist_cnn.train(args)
    assert result is not None and (result.global_step, result.workers) == (10, 1)


def _checkpoint_steps(logdir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (logdir / "checkpoints").glob("step-*"))


@needs_fashion_mnist
def test_example_writes_checkpoints_summaries_and_curves_and_a_second_run_resumes(tmp_path):
    logdir = tmp_path / "run"
    command = [
        sys.executable, str(EXAMPLE),
        "--log-every", "10", "--lr", "1e-3", "--train-limit", "3000", "--test-limit", "500",
        "--logdir", str(logdir), "--checkpoint-steps", "20", "--summary-steps", "10",
    ]  # fmt: skip
    first = run_local_cluster(1, 2, [*command, "--steps", "40"], timeout_s=200)
    assert first.returncode == 0, str(first)
    assert _checkpoint_steps(logdir)[-1] >= 40, str(first)
    assert list(logdir.glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (logdir / "metrics.png").read_bytes().startswith(b"\x89PNG"), "no PNG of the curves"
    lines = (logdir / "metrics.jsonl").read_text().splitlines()
    assert {"loss", "accuracy", "global_steps_per_sec"} <= set(json.loads(lines[0])), lines[0]

    second = run_local_cluster(1, 2, [*command, "--steps", "60"], timeout_s=200)
    assert second.returncode == 0, str(second)
    chief = second.output.of("worker:0")
    resumed = [line for line in chief if "restoring checkpoint" in line]
    assert resumed and "(global step 4" in resumed[0], str(second)
    steps = [
        int(re.search(r"Step: (\d+)", line).group(1))
        for task in ("worker:0", "worker:1")
        for line in second.output.of(task)
        if line.startswith("Worker:")
    ]
    assert steps and min(steps) > 40, f"the second run started over: {steps}\n{second}"

    fresh = run_local_cluster(1, 2, [*command, "--steps", "20", "--fresh"], timeout_s=200)
    assert fresh.returncode == 0, str(fresh)
    assert not any("restoring checkpoint" in line for line in fresh.output.of("worker:0"))
    assert _checkpoint_steps(logdir)[-1] < 40, "--fresh kept the old checkpoints"
