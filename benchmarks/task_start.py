"""How long a local cluster takes to start, and how much CPU it spends doing so, with its tasks
forked from the launcher's task fork server against each started in a fresh interpreter, in
the same run (tensorfleet.launch.backends.task_forks).

The run: ``LocalCluster(1, 3, cnn_training.py ...)``, the example's CNN (1 ps + 3 workers,
``--steps`` global steps), timed from ``start()`` to every worker's first step line ("first
step") and to the end of the run ("whole run"), and the CPU seconds of every process of the
run (``getrusage(RUSAGE_CHILDREN)`` around it: the fork server reaps its tasks and is reaped at
the end, so its tasks count). The two ways alternate, ``--repeats`` times each; medians.

    .venv/bin/python benchmarks/task_start.py [--repeats 3] [--steps 60] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))

from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet.launch.local_cluster import LocalCluster  # noqa: E402
from tensorfleet.launch.output import Output  # noqa: E402

STEP_LINE = re.compile(r"Step: (\d+)")
WORKERS = 3


class _FirstSteps(Output):
    """The time each worker printed its first step line; every line kept for a failure."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def line(self, task: str, text: str) -> None:
        with self._lock:
            self.lines.append(f"[{task}] {text}")
            if task.startswith("worker:") and task not in self.first and STEP_LINE.search(text):
                self.first[task] = time.monotonic()

    def message(self, text: str, level: str = "info") -> None:
        with self._lock:
            self.lines.append(f"[launcher] {level}: {text}")


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(fork_tasks: bool, steps: int, logdir: Path) -> dict[str, float]:
    """One cluster run: seconds to every worker's first step, to the end, and CPU seconds."""
    command = [
        sys.executable, str(HERE / "cnn_training.py"),
        "--steps", str(steps), "--log-every", "1", "--logdir", str(logdir),
        "--train-limit", "6000", "--test-limit", "500", "--fresh",
    ]  # fmt: skip
    output = _FirstSteps()
    cluster = LocalCluster(
        1,
        WORKERS,
        command,
        output=output,
        env={"PYTHONPATH": os.pathsep.join(sys.path)},
        spares=0,
        ps_spares=0,
        fork_tasks=fork_tasks,
    )
    cpu_before = _cpu_of_children()
    start = time.monotonic()
    try:
        cluster.start()
        status = cluster.wait(timeout=600)
    finally:
        cluster.stop()
    end = time.monotonic()
    cpu = _cpu_of_children() - cpu_before
    if status != 0 or len(output.first) != WORKERS:
        tail = "\n".join(output.lines[-40:])
        raise SystemExit(f"the run with fork_tasks={fork_tasks} failed ({status}):\n{tail}")
    return {
        "first_step_s": max(output.first.values()) - start,
        "whole_run_s": end - start,
        "cpu_s": cpu,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way (alternating)")
    parser.add_argument("--steps", type=int, default=60, help="global steps of each run")
    add_out_dir_option(parser)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"fresh": [], "forked": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for way in ("fresh", "forked"):
                run = one_run(way == "forked", args.steps, Path(tmp) / f"{way}{repeat}")
                runs[way].append(run)
                print(f"{way} {repeat + 1}/{args.repeats}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in run.items()), flush=True)  # fmt: skip
    medians = {
        way: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for way, rs in runs.items()
    }
    table = ["| what | fresh interpreters | forked from the server | ratio (forked / fresh) |"]
    table.append("|---|---|---|---|")
    for key, what in (
        ("first_step_s", "start() to every worker's first step (s)"),
        ("whole_run_s", f"start() to the end of the run, {args.steps} steps (s)"),
        ("cpu_s", "CPU seconds of every process of the run"),
    ):
        fresh, forked = medians["fresh"][key], medians["forked"][key]
        table.append(f"| {what} | {fresh:.2f} | {forked:.2f} | {forked / fresh:.2f}x |")
    heading = (
        f"Local cluster start, 1 ps + {WORKERS} workers of the CNN ({os.cpu_count()} CPUs; "
        f"median of {args.repeats} alternating runs each)"
    )
    write_results(
        "task_start",
        {"steps": args.steps, "repeats": args.repeats, "runs": runs, "medians": medians},
        heading,
        table,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
