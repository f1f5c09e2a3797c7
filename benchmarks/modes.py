"""The update disciplines on the CNN, in one run: throughput and accuracy at equal samples,
all-reduce against DistributedDataParallel used directly, and a straggler.

* ``async``, ``sync``, ``sync + 1 backup``, ``allreduce`` on 1 ps (none for all-reduce) +
  3 workers, each trained on the same number of samples (a sync or all-reduce step uses one
  batch per aggregated worker, an async step one batch);
* ``ddp_direct``: torch's DDP with gloo on the same 3 processes, no tensorfleet
  (benchmarks/ddp_baseline.py): all-reduce's baseline, run in alternation with all-reduce
  (the ratio is the median over the pairs);
* straggler: 4 workers, worker 3 computing 4x slower, for sync and for sync with one backup,
  each against the same run without the straggler.

Every tensorfleet run is the benchmark driver ``benchmarks/cnn_training.py`` (the example's
training, its ``--straggler`` flags and its ``--metrics-json`` figures) on a local cluster,
through ``throughput.example_run``.

    .venv/bin/python benchmarks/modes.py [--samples 45000]

Writes benchmarks/results/modes.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from cnn_training import WARMUP_STEPS  # noqa: E402
from results_writer import add_out_dir_option, write_results  # noqa: E402
from throughput import example_run  # noqa: E402

from tensorfleet.launch.local_cluster import LocalCluster  # noqa: E402
from tensorfleet.launch.output import Output  # noqa: E402

BATCH = 50


class Capture(Output):
    """Keeps the chief's lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, task: str, text: str) -> None:
        if task == "worker:0":
            self.lines.append(text)


def ddp_direct(steps: int, workers: int, timeout: float = 1800.0) -> float:
    """Steps/s of ``benchmarks/ddp_baseline.py`` on ``workers`` local processes (its chief's
    steady-state figure); RuntimeError naming the exit status and the chief's last lines when
    it fails, the launcher's DeadlineExceeded when it does not end within ``timeout`` seconds
    (its processes are stopped either way)."""
    capture = Capture()
    command = [sys.executable, str(ROOT / "benchmarks" / "ddp_baseline.py"), "--steps", str(steps)]
    cluster = LocalCluster(0, workers, command, output=capture, grace_period=20)
    try:
        cluster.start()
        code = cluster.wait(timeout=timeout)
    finally:
        cluster.stop()
    figures = [json.loads(line) for line in capture.lines if line.startswith("{")]
    if code != 0 or not figures:
        raise RuntimeError(f"the DDP baseline failed ({code}): {capture.lines[-5:]}")
    return figures[-1]["steps_per_s"]


def run_mode(
    name: str, samples: int, num_ps: int, workers: int, per_step: int, extra: tuple[str, ...]
) -> dict:
    steps = samples // (BATCH * per_step)
    figures = example_run(steps, num_ps, workers, extra)
    row = {
        "global_steps": steps,
        "global_steps_per_s": figures["steady_global_steps_per_s"],
        "samples_per_s": figures["steady_global_steps_per_s"] * BATCH * per_step,
        "test_accuracy": figures["test_accuracy"],
    }
    print(name, row, flush=True)
    return row


def too_short(samples: int, straggler_samples: int, pair_samples: int) -> list[str]:
    """What is wrong with sample counts whose runs would not pass the chief's warm-up.

    Each figure is the chief's steady state, timed after ``WARMUP_STEPS`` local steps. A
    sync or all-reduce global step takes one batch from every aggregated worker (so the
    chief makes one local step per global step); an async one a single batch (the chief
    makes about a third of the steps on 3 workers): each run needs more local steps than the
    warm-up. Returns one message per option that is too small (empty when every run passes).
    """
    least = WARMUP_STEPS + 1
    checks = (
        # (option, value, samples per chief local step in its tightest run, that run)
        ("--samples", samples, BATCH * 3, "sync and all-reduce on 3 workers"),
        ("--straggler-samples", straggler_samples, BATCH * 4, "sync on 4 workers"),
        ("--pair-samples", pair_samples, BATCH * 3, "all-reduce and DDP on 3 workers"),
    )
    return [
        f"{option} {value} gives the chief {value // per_step} local steps in its {run} "
        f"runs, not more than the {WARMUP_STEPS} warm-up steps its clock skips: no figure "
        f"could be measured; pass {option} {least * per_step} or more"
        for option, value, per_step, run in checks
        if value // per_step < least
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=45000, help="training samples per run")
    parser.add_argument("--straggler-samples", type=int, default=24000)
    parser.add_argument("--pairs", type=int, default=3, help="alternating all-reduce / DDP runs")
    parser.add_argument("--pair-samples", type=int, default=30000)
    add_out_dir_option(parser)
    args = parser.parse_args()
    for problem in too_short(args.samples, args.straggler_samples, args.pair_samples):
        parser.error(problem)

    rows: dict[str, dict] = {}
    rows["async"] = run_mode("async", args.samples, 1, 3, 1, ("--mode", "async"))
    rows["sync"] = run_mode("sync", args.samples, 1, 3, 3, ("--mode", "sync"))
    rows["sync_1_backup"] = run_mode(
        "sync_1_backup", args.samples, 1, 3, 2, ("--mode", "sync", "--replicas-to-aggregate", "2")
    )
    rows["allreduce"] = run_mode("allreduce", args.samples, 0, 3, 3, ("--mode", "allreduce"))
    # All-reduce against DDP used directly: alternating pairs, because this shared VM drifts
    # by tens of percent between minutes; the ratio is the median of the pairs' ratios.
    pair_steps = args.pair_samples // (BATCH * 3)
    ratios, ddp_rates, ours_rates = [], [], []
    for _ in range(args.pairs):
        ours = example_run(pair_steps, 0, 3, ("--mode", "allreduce"))
        ours_rates.append(ours["steady_global_steps_per_s"])
        ddp_rates.append(ddp_direct(pair_steps, 3))
        ratios.append(ours_rates[-1] / ddp_rates[-1])
        print("allreduce / ddp pair", ours_rates[-1], ddp_rates[-1], flush=True)
    ddp = statistics.median(ddp_rates)
    rows["ddp_direct"] = {
        "global_steps": pair_steps,
        "global_steps_per_s": ddp,
        "samples_per_s": ddp * BATCH * 3,
    }
    rows["allreduce"]["ratio_vs_ddp_direct"] = statistics.median(ratios)
    rows["allreduce"]["pairs"] = {"allreduce_steps_per_s": ours_rates, "ddp_steps_per_s": ddp_rates}

    straggler = ("--straggler", "3", "--straggler-slowdown", "4")
    s = args.straggler_samples
    rows["straggler_sync_4w_none"] = run_mode("sync 4w", s, 1, 4, 4, ("--mode", "sync"))
    rows["straggler_sync_4w_slow"] = run_mode(
        "sync 4w straggler", s, 1, 4, 4, ("--mode", "sync", *straggler)
    )
    backup = ("--mode", "sync", "--replicas-to-aggregate", "3")
    rows["straggler_backup_4w_none"] = run_mode("sync+backup 4w", s, 1, 4, 3, backup)
    rows["straggler_backup_4w_slow"] = run_mode(
        "sync+backup 4w straggler", s, 1, 4, 3, (*backup, *straggler)
    )
    for kind in ("sync", "backup"):
        slow, none = rows[f"straggler_{kind}_4w_slow"], rows[f"straggler_{kind}_4w_none"]
        slow["ratio_vs_no_straggler"] = slow["global_steps_per_s"] / none["global_steps_per_s"]

    result = {
        "benchmark": "update disciplines on the CNN (batch 50 per worker step, Adam 1e-4)",
        "samples": args.samples,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    table = [
        "| run | global steps/s | samples/s | test accuracy | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        ratio = row.get("ratio_vs_ddp_direct") or row.get("ratio_vs_no_straggler")
        label = " vs DDP" if "ratio_vs_ddp_direct" in row else " vs no straggler" if ratio else ""
        accuracy = f"{row['test_accuracy']:.3f}" if "test_accuracy" in row else ""
        table.append(
            f"| {name} | {row['global_steps_per_s']:.2f} | {row['samples_per_s']:.0f} | {accuracy} | {f'{ratio:.2f}x{label}' if ratio else ''} |"
        )
    write_results(
        "modes",
        result,
        f"{result['benchmark']}, {args.samples} samples per run ({args.straggler_samples} for the straggler runs), {result['date']}",
        table,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
