"""Capacity of one parameter-server shard: pushes applied per second and the latency of a
push+pull (p50, p99) as the number of workers grows, for a small and a large model.

Every point is a fresh ``tensorfleet server`` ps on localhost and N worker processes that
push+pull (SGD) as fast as they can for ``--duration`` seconds, all starting at one instant.
On this project's 2-vCPU machine the workers compete with the ps for the cores, so the
figures are what one machine serves, not the ps alone. Points run in ``--repeats`` rounds,
interleaved (every worker count once per round); medians are reported.

    .venv/bin/python benchmarks/ps_capacity.py [--workers 1 2 4 8 16 --duration 4]

Writes benchmarks/results/ps_capacity.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ps_load import ROOT, run_load, summarize  # noqa: E402
from results_writer import add_out_dir_option, write_results  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))
from tensorfleet.launch.ports import free_port  # noqa: E402

MODELS = {
    "small (100 KB, 4 variables)": {"bytes": 100_000, "variables": 4},
    "large (8 MB, 16 variables)": {"bytes": 8_000_000, "variables": 16},
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--shared-memory", choices=("0", "1"), default="1", help="the same-host fast path"
    )
    add_out_dir_option(parser)
    args = parser.parse_args()
    env = {"TENSORFLEET_SHARED_MEMORY": args.shared_memory}
    runs: dict[str, dict[int, list[dict]]] = {m: {n: [] for n in args.workers} for m in MODELS}
    for _ in range(args.repeats):
        for name, model in MODELS.items():
            for workers in args.workers:
                reports = run_load([f"127.0.0.1:{free_port()}"], workers, model, args.duration, env)
                runs[name][workers].append(summarize(reports, args.duration, model["bytes"]))
                print(name, workers, runs[name][workers][-1], flush=True)
    table = [
        "| model | workers | pushes/s | push+pull MB/s | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    rows = {}
    for name, by_workers in runs.items():
        for workers, points in by_workers.items():
            row = {
                key: statistics.median(p[key] for p in points)
                for key in (
                    "pushes_per_s",
                    "push_pull_mb_per_s",
                    "latency_p50_ms",
                    "latency_p99_ms",
                )
            }
            row["repeats"] = points
            rows[f"{name} / {workers}"] = row
            table.append(
                f"| {name} | {workers} | {row['pushes_per_s']:.0f} | "
                f"{row['push_pull_mb_per_s']:.0f} | {row['latency_p50_ms']:.2f} | "
                f"{row['latency_p99_ms']:.2f} |"
            )
    result = {
        "benchmark": "one ps shard under load (localhost)",
        "duration_s": args.duration,
        "shared_memory": args.shared_memory == "1",
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    heading = (
        f"{result['benchmark']}, {args.duration:g} s per point, shared memory "
        f"{'on' if result['shared_memory'] else 'off'}, medians of {args.repeats}, {result['date']}"
    )
    write_results("ps_capacity", result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
