"""Every benchmark in one command (``make bench``): runs each script, then writes
``benchmarks/results/bench.json`` (the machine, the versions, every command with its exit
status, and each benchmark's own JSON) and ``bench.md`` (the machine and one table of the
headline figures, each with its target and the command that measured it).

    .venv/bin/python benchmarks/run_all.py [--quick]

``--quick`` runs every benchmark with small settings (a smoke test of the scripts, not a
measurement). A benchmark that cannot run here (the link emulation needs root, the
TensorFlow rows need ``make tf-reference``) says so in the table instead of a figure.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from results_writer import RESULTS, write_results  # noqa: E402

SPARSE_TABLES_QUICK = "--repeats 1 --rows 100000 --sparse-steps 20 --dense-steps 3".split()
SPARSE_TABLES_QUICK += "--big-rows 2000000 --big-steps 50".split()

#: name -> (script arguments, quick arguments)
BENCHMARKS = {
    "wire": ([], ["--megabytes", "8", "--batches", "2", "--per-batch", "5"]),
    "wire_floor": ([], ["--megabytes", "8", "--batches", "2", "--per-batch", "5"]),
    "ps_capacity": ([], ["--workers", "1", "4", "--duration", "1"]),
    "ps_sharding_links": ([], ["--duration", "2"]),
    "throughput": ([], ["--steps", "100", "--repeats", "1"]),
    "modes": ([], ["--samples", "3000"]),
    "sparse_tables": ([], SPARSE_TABLES_QUICK),
}


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        memory_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        memory_kb = 0
    versions = {}
    for package in ("tensorfleet", "torch", "pyzmq", "cryptography", "msgpack"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    tf_python = ROOT / ".venv-tf" / "bin" / "python"
    if tf_python.exists():
        probe = subprocess.run(
            [str(tf_python), "-c", "import tensorflow as tf; print(tf.__version__)"],
            capture_output=True,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
        versions["tensorflow"] = probe.stdout.strip() or None
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": round(memory_kb / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
        "versions": versions,
    }


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def headlines(results: dict[str, dict | None]) -> list[tuple[str, str, str, str]]:
    """(benchmark, figure, value, target) rows from the benchmarks' own JSON."""
    rows = []
    wire = results.get("wire")
    if wire:
        for size, kinds in wire["sizes"].items():
            for kind, target in (
                ("push_pull", ">= 0.9x"),
                ("pull", ">= 0.9x"),
                ("push_pull_encrypted", ">= 0.5x"),
                ("push_pull_shared_memory", ">= 3x"),
            ):
                row = kinds[kind]
                same_work = row.get("ratio_vs_raw_tcp_sgd")
                rows.append(
                    (
                        "wire",
                        f"{kind}, {size} MB, vs raw TCP echo"
                        + ("" if same_work is None else " (vs raw TCP + SGD)"),
                        f"{row['ratio_vs_raw_tcp']:.2f}x ({row['median_ms']:.2f} ms)"
                        + ("" if same_work is None else f" ({same_work:.2f}x)"),
                        target,
                    )
                )
    floor = results.get("wire_floor")
    if floor:  # what the work of a push+pull itself reaches: the targets' floor here
        for size, kinds in floor["sizes"].items():
            for kind, what in (
                ("zmq_gmac_sgd_echo", "authenticated SGD push+pull over bare ZeroMQ"),
                ("zmq_gmac_sgd_pipelined", "the same, streamed in 1 MiB messages"),
                ("same_host_floor_authenticated", "same-host copies, update and GMAC"),
            ):
                row = kinds.get(kind)
                if row is not None:
                    rows.append(
                        (
                            "wire_floor",
                            f"{kind}, {size} MB, vs raw TCP echo ({what})",
                            f"{row['ratio_vs_raw_tcp']:.2f}x ({row['median_ms']:.2f} ms)",
                            "floor of the wire targets",
                        )
                    )
    capacity = results.get("ps_capacity")
    if capacity:
        for name, row in capacity["rows"].items():
            rows.append(
                (
                    "ps_capacity",
                    f"{name} workers",
                    f"{row['pushes_per_s']:.0f} pushes/s, p50 {row['latency_p50_ms']:.1f} ms, "
                    f"p99 {row['latency_p99_ms']:.1f} ms",
                    "",
                )
            )
    sharding = results.get("ps_sharding_links")
    if sharding:
        for shards, row in sharding["rows"].items():
            target = {"2": ">= 1.8x", "4": ">= 3.2x"}.get(shards, "")
            rows.append(
                (
                    "ps_sharding_links",
                    f"{shards} ps, aggregate push+pull vs 1 ps",
                    f"{row['ratio']:.2f}x ({row['push_pull_mb_per_s']:.0f} MB/s)",
                    target,
                )
            )
    throughput = results.get("throughput")
    if throughput:
        for name, row in throughput["rows"].items():
            if "missing" in row:
                rows.append(("throughput", name, f"not measured: {row['missing']}", ""))
                continue
            value = (
                f"{row['steps_per_s']:.2f} steps/s, {row['ratio_vs_pytorch_single']:.2f}x "
                "one-process PyTorch"
            )
            if "ratio_vs_tensorflow_single" in row:
                value += f", {row['ratio_vs_tensorflow_single']:.2f}x one-process TensorFlow"
            target = ">= 0.95x PyTorch, >= 1.0x TensorFlow" if "async" in name else ""
            rows.append(
                ("throughput", name, value, target if name.startswith("tensorfleet") else "")
            )
    tables = results.get("sparse_tables")
    if tables:
        for name, value in tables["ratios"].items():
            target = ""
            if name.endswith("_bytes") and "dense" not in name:
                target = "about 1.0x (bytes follow the unique ids, not the table)"
            rows.append(("sparse_tables", name, f"{value:.2f}x", target))
        big = tables.get("big")
        if big:
            rows.append(
                (
                    "sparse_tables",
                    f"{big['rows']:,} x {big['dim']} table on 2 ps, {big['steps']} steps",
                    f"worker peak RSS {big['memory_kib']['VmHWM'] / 2**20:.2f} GiB for a "
                    f"{big['table_bytes'] / 2**30:.2f} GiB table",
                    "far below the table",
                )
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS))
    args = parser.parse_args()
    info = machine()
    runs = {}
    for name, (full, quick) in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        command = [sys.executable, str(HERE / f"{name}.py"), *(quick if args.quick else full)]
        print(f"== {name}: {' '.join(command)}", flush=True)
        started = time.time()
        status = subprocess.run(command, cwd=ROOT).returncode
        runs[name] = {
            "command": " ".join(["python", f"benchmarks/{name}.py", *command[2:]]),
            "exit_status": status,
            "seconds": round(time.time() - started, 1),
        }
    results = {name: _load(name) if runs[name]["exit_status"] == 0 else None for name in runs}
    table = ["| benchmark | figure | value | target | command |", "|---|---|---|---|---|"]
    for bench, figure, value, target in headlines(results):
        table.append(f"| {bench} | {figure} | {value} | {target} | `{runs[bench]['command']}` |")
    for name, run in runs.items():
        if run["exit_status"] != 0:
            table.append(
                f"| {name} | not measured (exit status {run['exit_status']}; see its output) | | | `{run['command']}` |"
            )
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    heading = (
        f"`make bench`{' --quick' if args.quick else ''}, {time.strftime('%Y-%m-%d %H:%M')}: "
        f"{info['cpu']} ({info['cpus']} CPUs, {info['memory_gib']} GiB), {info['platform']}, "
        f"Python {info['python']}, {versions}; load average at start "
        f"{', '.join(f'{x:.1f}' for x in info['load_average_at_start'])}"
    )
    write_results("bench", {"machine": info, "runs": runs, "results": results}, heading, table)
    return 0 if all(r["exit_status"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
