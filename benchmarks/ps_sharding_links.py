"""Sharding over emulated links: aggregate push+pull throughput of 1, 2 and 4 ps shards
serving 4 workers, every task on a "host" of its own whose link is rate-limited.

Each task runs in a Linux network namespace of its own (``tests/multihost/netns.py``: veth
pairs on a bridge in a hub namespace; nothing is added to the root namespace, and only these
namespaces receive traffic). Both ends of every veth get a ``tc`` token-bucket filter of
``--rate`` (default 1gbit), so each host sends and receives at most that: the ps's link is
the bottleneck of one shard, and sharding the model over more ps hosts spreads it.
``TENSORFLEET_SHARED_MEMORY=0``: the namespaces share one kernel, but these are meant as
separate hosts. Needs root. Rounds interleave the shard counts (``--repeats``); medians.

    sudo .venv/bin/python benchmarks/ps_sharding_links.py [--megabytes 16 --duration 6]

Writes benchmarks/results/ps_sharding_links.json and .md (``_RATE`` added to the name for a
``--rate`` other than 1gbit). On a 2-core machine the CPU, not a 1 Gbit/s link, bounds 4 ps
+ 4 workers (every byte is copied and MACed on both ends); a lower ``--rate`` (250mbit) shows
the scaling where the links are the bottleneck.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ps_load import ROOT, run_load, summarize  # noqa: E402
from results_writer import add_out_dir_option, not_run, write_results  # noqa: E402

sys.path.insert(0, str(ROOT))
from tests.multihost.netns import NetworkNamespaces, namespaces_available  # noqa: E402

WORKERS = 4
PORT = 2222


def limit_links(hosts: NetworkNamespaces, rate: str) -> None:
    """A token-bucket filter of ``rate`` on both ends of every host's veth."""
    tbf = ["root", "tbf", "rate", rate, "burst", "512kb", "latency", "100ms"]
    for index, name in enumerate(hosts.names):
        for argv in (
            ["tc", "-n", name, "qdisc", "replace", "dev", "eth0", *tbf],
            ["tc", "-n", hosts.hub, "qdisc", "replace", "dev", f"p{index}", *tbf],
        ):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def measure(num_ps: int, model: dict, duration_s: float, rate: str) -> dict:
    with NetworkNamespaces(num_ps + WORKERS) as hosts:
        limit_links(hosts, rate)
        ps = [f"{hosts.address(i)}:{PORT}" for i in range(num_ps)]
        reports = run_load(
            ps,
            WORKERS,
            model,
            duration_s,
            {"TENSORFLEET_SHARED_MEMORY": "0"},
            ps_prefix=[hosts.exec_argv(i, []) for i in range(num_ps)],
            worker_prefix=[hosts.exec_argv(num_ps + i, []) for i in range(WORKERS)],
        )
    return summarize(reports, duration_s, model["bytes"])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--megabytes", type=float, default=16.0)
    parser.add_argument("--variables", type=int, default=16)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--repeats", type=int, default=1)
    add_out_dir_option(parser)
    args = parser.parse_args()
    reason = namespaces_available()
    if reason is not None:
        return not_run("ps_sharding_links", reason)
    model = {"bytes": int(args.megabytes * 1e6) // 4 * 4, "variables": args.variables}
    runs: dict[int, list[dict]] = {n: [] for n in args.shards}
    for _ in range(args.repeats):
        for num_ps in args.shards:
            runs[num_ps].append(measure(num_ps, model, args.duration, args.rate))
            print(num_ps, runs[num_ps][-1], flush=True)
    base = statistics.median(p["push_pull_mb_per_s"] for p in runs[args.shards[0]])
    rows = {}
    table = [
        f"| ps shards | aggregate push+pull MB/s | ratio vs {args.shards[0]} ps | steps/s | p50 ms | p99 ms |",
        "|---|---|---|---|---|---|",
    ]
    for num_ps, points in runs.items():
        row = {
            key: statistics.median(p[key] for p in points)
            for key in ("push_pull_mb_per_s", "pushes_per_s", "latency_p50_ms", "latency_p99_ms")
        }
        row["ratio"] = row["push_pull_mb_per_s"] / base
        row["repeats"] = points
        rows[str(num_ps)] = row
        table.append(
            f"| {num_ps} | {row['push_pull_mb_per_s']:.0f} | {row['ratio']:.2f}x | "
            f"{row['pushes_per_s']:.1f} | {row['latency_p50_ms']:.1f} | {row['latency_p99_ms']:.1f} |"
        )
    result = {
        "benchmark": f"{WORKERS} workers, {args.megabytes:g} MB model, {args.rate} links per host",
        "duration_s": args.duration,
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    heading = f"{result['benchmark']}, {args.duration:g} s per point, medians of {args.repeats}, {result['date']}"
    # The default rate keeps the historic name; another rate gets its own files.
    name = "ps_sharding_links" if args.rate == "1gbit" else f"ps_sharding_links_{args.rate}"
    write_results(name, result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
