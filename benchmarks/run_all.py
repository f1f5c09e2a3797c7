"""Every benchmark in one command (``make bench``): runs each script of :data:`BENCHMARKS`,
then writes ``bench.json`` (the machine, the versions, every command with its outcome, and
each benchmark's own JSON) and ``bench.md`` (the machine and one table of the headline
figures, each with its target and the command that measured it).

    .venv/bin/python benchmarks/run_all.py [--quick] [--only NAME ...] [--out-dir DIR]

Every benchmark's results and ``bench.*`` go to ``benchmarks/results`` (replacing the
committed tables the docs cite) unless ``--out-dir DIR`` (or ``TENSORFLEET_BENCH_OUT=DIR``)
names another directory. ``--quick`` runs every benchmark with small settings: a smoke test
of the scripts, not a measurement, so without ``--out-dir`` its results go to a new
temporary directory (printed), never over the committed tables.

Each benchmark ends in one of three outcomes: it ran (exit status 0, its JSON written); it
was skipped (it cannot run here for a reason it printed: the link emulation needs root for
network namespaces); or it failed (any other exit status, or no JSON). Skips and failures get
a row with their reason. The exit status is 0 when nothing failed, 1 otherwise. TensorFlow
missing is not a skip of a whole benchmark: the TensorFlow rows of ``throughput`` say why.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from results_writer import (  # noqa: E402
    NOT_RUN_MARK,
    NOT_RUN_STATUS,
    OUT_ENV,
    add_out_dir_option,
    results_dir,
    write_results,
)


@dataclass(frozen=True)
class Benchmark:
    """One benchmark run by ``make bench``: its script, its arguments (the documented
    measurement, and ``--quick``'s smoke-test settings) and the results file it writes."""

    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    results: str


SPARSE_TABLES_QUICK = "--repeats 1 --rows 100000 --sparse-steps 20 --dense-steps 3".split()
SPARSE_TABLES_QUICK += "--big-rows 2000000 --big-steps 50".split()

#: name -> the benchmark. Every script of benchmarks/ that measures something is here; the
#: others are helpers (cnn_training, compute_rates, ddp_baseline, ps_load, results_writer),
#: drawing (timeline_picture) or this file. ``quick`` settings pass every warm-up.
BENCHMARKS: dict[str, Benchmark] = {
    "wire": Benchmark(
        "wire", (), ("--megabytes", "8", "--batches", "2", "--per-batch", "5"), "wire"
    ),
    "wire_floor": Benchmark(
        "wire_floor", (), ("--megabytes", "8", "--batches", "2", "--per-batch", "5"), "wire_floor"
    ),
    "wire_profile": Benchmark(
        "wire_profile", (), ("--megabytes", "1", "--rounds", "10"), "wire_profile_push_pull"
    ),
    "host_allreduce": Benchmark(
        "host_allreduce",
        (),
        ("--megabytes", "1", "--calls", "3", "--rounds", "1"),
        "host_allreduce",
    ),
    "task_start": Benchmark("task_start", (), ("--repeats", "1", "--steps", "5"), "task_start"),
    "request_cost": Benchmark(
        "request_cost", (), ("--rounds", "100", "--batches", "2"), "request_cost"
    ),
    "ps_capacity": Benchmark(
        "ps_capacity", (), ("--workers", "1", "4", "--duration", "1"), "ps_capacity"
    ),
    "ps_sharding_links": Benchmark(
        "ps_sharding_links", (), ("--duration", "2"), "ps_sharding_links"
    ),
    "throughput": Benchmark("throughput", (), ("--steps", "100", "--repeats", "1"), "throughput"),
    "modes": Benchmark(
        "modes",
        (),
        (
            "--samples",
            "6000",
            "--straggler-samples",
            "6000",
            "--pairs",
            "1",
            "--pair-samples",
            "6000",
        ),
        "modes",
    ),
    "overlap": Benchmark(
        "overlap",
        ("--models", "cnn", "mlp", "--steps", "200", "--repeats", "4"),
        ("--models", "cnn", "--steps", "60", "--repeats", "1"),
        "overlap",
    ),
    "overlap_links": Benchmark(
        "overlap",
        ("--models", "cnn", "mlp", "--steps", "120", "--repeats", "3", "--rate", "1gbit"),
        ("--models", "cnn", "--steps", "60", "--repeats", "1", "--rate", "1gbit"),
        "overlap_1gbit",
    ),
    "sparse_tables": Benchmark("sparse_tables", (), tuple(SPARSE_TABLES_QUICK), "sparse_tables"),
    "raw_id_tables": Benchmark(
        "raw_id_tables",
        (),
        ("--known", "100000", "--steps", "10", "--repeats", "1"),
        "raw_id_tables",
    ),
    # The BERT-base-sized model: the full run takes minutes of a quiet 2-core machine; --quick
    # a tiny model (a smoke test).
    "big_model": Benchmark("big_model", (), ("--quick",), "big_model"),
    "ps_update": Benchmark(
        "ps_update", (), ("--quick", "--rounds", "1", "--updates", "1"), "ps_update"
    ),
    "delta_checkpoints": Benchmark(
        "delta_checkpoints",
        (),
        ("--rows", "50000", "--repeats", "1"),
        "delta_checkpoints",
    ),
    "cnn_compute": Benchmark("cnn_compute", (), ("--steps", "5", "--rounds", "1"), "cnn_compute"),
    "devices": Benchmark("devices", (), ("--steps", "60", "--pairs", "1"), "devices"),
    "gpu": Benchmark("gpu", (), ("--steps", "200", "--tests-limit", "120"), "gpu"),
    "recovery": Benchmark("recovery", ("--repeats", "7"), ("--repeats", "1"), "recovery"),
    "patterns": Benchmark(
        "patterns",
        ("--trials", "8", "--slots", "2", "--steps", "400", "--al-steps", "30000"),
        (
            "--trials",
            "2",
            "--slots",
            "2",
            "--steps",
            "50",
            "--al-steps",
            "2000",
            "--search-trials",
            "3",
            "--search-steps",
            "30",
        ),
        "patterns",
    ),
    "pbt": Benchmark(
        "pbt",
        (),
        ("--copy-params", "100000", "--copy-repeats", "3", "--seeds", "1", "--rounds", "3"),
        "pbt",
    ),
    # The quick chaos run checks the machinery (a kill, the recovery, the checkpoints, no
    # process left), not the accuracy: 2,000 steps are too few for the 0.01 bound.
    "chaos": Benchmark(
        "chaos",
        (),
        (
            "--steps",
            "2000",
            "--kills",
            "1",
            "--min-interval",
            "10",
            "--max-interval",
            "12",
            "--tolerance",
            "1",
        ),
        "chaos",
    ),  # fmt: skip
    # The storm: mixed SIGKILL / SIGTERM / SIGSTOP every 10 s for 10 minutes; the quick run
    # checks the machinery with a 30 s storm and no undisturbed run.
    "chaos_storm": Benchmark(
        "chaos",
        ("--storm", "--steps", "40000"),
        ("--storm", "--steps", "1500", "--calm", "10", "--duration", "30", "--no-baseline"),
        "chaos_storm",
    ),
}


@dataclass(frozen=True)
class Outcome:
    """How one benchmark's run ended: ``ran``, ``skipped`` or ``failed``, and why."""

    kind: str
    reason: str = ""


def classify(status: int, output: list[str], wrote_results: bool) -> Outcome:
    """The outcome of a run from its exit status, its output lines and whether its JSON exists.

    A skip is the status :data:`NOT_RUN_STATUS` together with the ``<name>: not run: <reason>``
    line the script printed (``results_writer.not_run``): the reason goes into the row. That
    status without such a line, or any other non-zero status, is a failure, as is a status 0
    that left no results file.
    """
    if status == 0:
        if wrote_results:
            return Outcome("ran")
        return Outcome("failed", "exit status 0, but it wrote no results file")
    if status == NOT_RUN_STATUS:
        reasons = [
            line.split(NOT_RUN_MARK, 1)[1].strip() for line in output if NOT_RUN_MARK in line
        ]
        if reasons and reasons[-1]:
            return Outcome("skipped", reasons[-1])
        return Outcome("failed", f"exit status {status} (not run) without a reason printed")
    last = next((line.strip() for line in reversed(output) if line.strip()), "")
    return Outcome("failed", f"exit status {status}" + (f": {last[-300:]}" if last else ""))


def exit_status(outcomes: dict[str, Outcome]) -> int:
    """0 when every benchmark ran or was skipped with a reason, 1 when one failed."""
    return 1 if any(o.kind == "failed" for o in outcomes.values()) else 0


def tf_python() -> str:
    """The Python with TensorFlow: ``$TF_PYTHON`` (as ``throughput.py`` honours it), else
    ``.venv-tf`` (``make tf-reference``)."""
    return os.environ.get("TF_PYTHON") or str(ROOT / ".venv-tf" / "bin" / "python")


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
    python = tf_python()
    if Path(python).exists():
        probe = subprocess.run(
            [python, "-c", "import tensorflow as tf; print(tf.__version__)"],
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


def _load(results: str) -> dict | None:
    path = results_dir() / f"{results}.json"
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
    cost = results.get("request_cost")
    if cost:
        echo = cost["medians"]["zmq_echo"]
        for kind in ("heartbeat", "push_pull"):
            row = cost["medians"][kind]
            rows.append(
                (
                    "request_cost",
                    f"{kind}: CPU per round trip, client thread + ps, vs a bare ZeroMQ echo",
                    f"{row['client_us']:.0f} + {row['server_us']:.0f} us = "
                    f"{(row['client_us'] + row['server_us']) / (echo['client_us'] + echo['server_us']):.2f}x",
                    "",
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
                rows.append(("throughput", name, f"skipped: {row['missing']}", ""))
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
    rows += _modes_headlines(results.get("modes"))
    rows += _other_headlines(results)
    raw = results.get("raw_id_tables")
    if raw:
        for key in ("raw_vs_hashed_step_time", "raw_new_ids_vs_hashed_step_time"):
            rows.append(("raw_id_tables", key, f"{raw[key]:.2f}x", ""))
    deltas = results.get("delta_checkpoints")
    if deltas:
        for table in ("hashed", "raw"):
            for key in ("delta_vs_full_bytes", "delta_vs_full_seconds"):
                rows.append(
                    ("delta_checkpoints", f"{table} {key}", f"{deltas[table][key]:.3f}x", "")
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


def _modes_headlines(modes: dict | None) -> list[tuple[str, str, str, str]]:
    """The update disciplines: all-reduce against DDP used directly, the straggler runs."""
    if not modes:
        return []
    runs, rows = modes["rows"], []
    for name in ("async", "sync", "sync_1_backup", "allreduce", "ddp_direct"):
        if name in runs:
            value = f"{runs[name]['global_steps_per_s']:.2f} global steps/s"
            if "test_accuracy" in runs[name]:
                value += f", test accuracy {runs[name]['test_accuracy']:.3f}"
            rows.append(("modes", f"{name}, 3 workers", value, ""))
    if "ratio_vs_ddp_direct" in runs.get("allreduce", {}):
        ratio = runs["allreduce"]["ratio_vs_ddp_direct"]
        rows.append(
            (
                "modes",
                "allreduce vs DDP used directly (median of pairs)",
                f"{ratio:.2f}x",
                ">= 0.97x",
            )
        )
    for kind, target in (("sync", ""), ("backup", ">= 0.8x")):
        slow = runs.get(f"straggler_{kind}_4w_slow", {})
        if "ratio_vs_no_straggler" in slow:
            rows.append(
                (
                    "modes",
                    f"{'sync' if kind == 'sync' else 'sync + 1 backup'}, 4 workers, one 4x "
                    "slower, vs none slower",
                    f"{slow['ratio_vs_no_straggler']:.2f}x",
                    target,
                )
            )
    return rows


def _other_headlines(results: dict[str, dict | None]) -> list[tuple[str, str, str, str]]:
    """One or two figures of each remaining benchmark (their tables hold the rest)."""
    rows = []
    for size, row in ((results.get("host_allreduce") or {}).get("sizes") or {}).items():
        rows.append(
            (
                "host_allreduce",
                f"all-reduce of a {float(size):g} MB bucket over 3 processes on one host, "
                "through shared memory vs over gloo",
                f"{row['ratio']:.2f}x ({row['shared_memory_ms']:.2f} vs {row['gloo_ms']:.2f} ms)",
                "> 1x",
            )
        )
    start = (results.get("task_start") or {}).get("medians") or {}
    if start:
        fresh, forked = start["fresh"]["first_step_s"], start["forked"]["first_step_s"]
        rows.append(
            (
                "task_start",
                "a local 1 ps + 3 worker cluster from start() to every worker's first step, "
                "tasks forked from the task fork server vs fresh interpreters",
                f"{forked / fresh:.2f}x ({forked:.1f} vs {fresh:.1f} s)",
                "< 1x",
            )
        )
    profile = results.get("wire_profile")
    if profile:
        rows.append(
            (
                "wire_profile",
                profile["benchmark"],
                f"{profile['ms_per_round']:.2f} ms per round",
                "",
            )
        )
    for name in ("overlap", "overlap_links"):
        overlap = results.get(name)
        for label, row in (overlap or {}).get("rows", {}).items():
            if label.endswith(" buckets+prefetch"):
                rows.append(
                    (
                        name,
                        f"{label} vs sequential, {overlap['benchmark']}",
                        f"{row['ratio']:.2f}x ({row['steps_per_s']:.2f} global steps/s)",
                        "",
                    )
                )
    compute = results.get("cnn_compute")
    for variant in ("plain", "channels_last_fused_adam"):
        row = (compute or {}).get("rows", {}).get(variant)
        if row and "ms_per_step" in row:
            rows.append(
                (
                    "cnn_compute",
                    f"{variant}, one thread",
                    f"{row['ms_per_step']:.1f} ms per step",
                    "",
                )
            )
    devices = (results.get("devices") or {}).get("rows", {})
    if "budget_vs_oversubscribed_median_ratio" in devices:
        ratio = devices["budget_vs_oversubscribed_median_ratio"]
        rows.append(("devices", "thread budget vs every task all cores", f"{ratio:.2f}x", ""))
    recovery = results.get("recovery")
    if recovery:
        costs, ps = recovery["checkpoint_s"], recovery["ps_recovery"]
        ours, base = statistics.median(costs["tensorfleet"]), statistics.median(costs["baseline"])
        rows.append(
            (
                "recovery",
                "checkpoint vs safetensors.save_file + fsync",
                f"{ours / base:.2f}x ({ours * 1e3:.0f} ms)",
                "",
            )
        )
        restored = ps["kill_to_first_step_after_restore_s"]
        rows.append(
            (
                "recovery",
                "ps SIGKILL -> first step after the restore, vs a fresh launch's first step",
                f"{restored / ps['fresh_start_to_first_step_s']:.2f}x ({restored:.1f} s)",
                "",
            )
        )
    patterns = results.get("patterns")
    if patterns:
        for part, label in (
            ("sweep", "sweep, slots vs 1 slot"),
            ("actor_learner", "actor/learner vs one process"),
        ):
            if part in patterns:
                rows.append(("patterns", label, f"{patterns[part]['ratio']:.2f}x", ""))
        search = patterns.get("search")
        if search:
            for run, label in (("one_slot", "1 slot"), ("two_slots", "2 slots")):
                got = search[run]
                rows.append(
                    (
                        "patterns",
                        f"search of ~1 s trials, tensorfleet sweep {label} vs an Optuna loop by hand",
                        f"{got['ratio_to_hand_loop']:.2f}x (wall {got['wall_to_ideal']:.2f}x ideal)",
                        "",
                    )
                )
    pbt = results.get("pbt")
    if pbt:
        copy = pbt["copy"]
        rows.append(
            (
                "pbt",
                f"exploit copy of a {copy['params'] / 1e6:g} M-parameter member with Adam's "
                "state (copy_model round trip)",
                f"{copy['copy_round_trip_ms']:.1f} ms ({copy['copy_to_pull']:.2f}x a pull)",
                "< 50 ms",
            )
        )
        runs = pbt["pbt"]["runs"]
        rows.append(
            (
                "pbt",
                f"PBT, 4 members, vs the best of 4 fixed learning rates, same budget, "
                f"{len(runs)} seeds (best-fixed score / PBT score)",
                ", ".join(f"{run['fixed_to_pbt']:.2f}x" for run in runs),
                "> 1x on every seed",
            )
        )
    rows += _big_model_headlines(results.get("big_model"))
    rows += _gpu_headlines(results.get("gpu"))
    for rule, row in ((results.get("ps_update") or {}).get("rows") or {}).items():
        rows.append(
            (
                "ps_update",
                f"the ps's {rule} update of the BERT-base-sized shard, pieces vs whole variables "
                "(bit for bit equal)",
                f"{row['whole']['ms_per_update'] / row['pieces']['ms_per_update']:.2f}x "
                f"({row['pieces']['ms_per_update']:.0f} ms; one process's torch.optim "
                f"{row['torch']['ms_per_update']:.0f} ms)"
                + ("" if row["pieces_equal_whole_bit_for_bit"] else "; NOT EQUAL"),
                "",
            )
        )
        if "fused" in row:  # the rule by name: torch's fused kernel, its default
            rows.append(
                (
                    "ps_update",
                    f"the ps's {rule} update of the BERT-base-sized shard by name (fused kernel) "
                    "vs one process's torch.optim",
                    f"{row['fused']['vs_torch']:.2f}x ({row['fused']['ms_per_update']:.0f} ms)",
                    "",
                )
            )
    storm = results.get("chaos_storm")
    if storm:
        kills = storm["recovery"].get("kill worker (spare)") or storm["recovery"].get(
            "kill worker (fresh process)"
        )
        rows.append(
            (
                "chaos_storm",
                f"{len(storm['faults'])} faults in {storm['duration_s']:g} s: global steps/min "
                "during vs before",
                f"{storm['during_vs_before']:.2f}x"
                + (f"; worker SIGKILL back in {kills['p50_s']:.1f} s (p50)" if kills else "")
                + f"; {sum(storm['checks'].values())} of {len(storm['checks'])} checks passed",
                "every check",
            )
        )
    chaos = results.get("chaos")
    if chaos:
        failed = [name for name, ok in chaos["checks"].items() if not ok]
        rows.append(
            (
                "chaos",
                f"{len(chaos['kills'])} kills, seed {chaos['seed']}, {chaos['steps']} steps",
                f"{len(chaos['checks']) - len(failed)} of {len(chaos['checks'])} checks passed"
                + (f" (failed: {', '.join(failed)})" if failed else ""),
                "every check",
            )
        )
    return rows


#: The GPU check's targets (the GPU and data-plane issues), by row name.
GPU_TARGETS = {
    "1 ps + 1 worker, async": ">= 0.6x",
    "1 ps + 3 workers sharing one GPU, async": ">= 0.6x",
    "all-reduce, 3 workers sharing one GPU (gloo)": ">= 0.8x",  # the name before 2026-11-27
    "all-reduce, 3 workers sharing one GPU (shared memory)": ">= 0.8x",
}


def _gpu_headlines(gpu: dict | None) -> list[tuple[str, str, str, str]]:
    """The GPU check's rows against one process on the same GPU (batches/s), its tests."""
    if not gpu:
        return []
    card = gpu.get("card", "a GPU")
    rows = []
    tests = gpu.get("tests")
    if tests is not None:
        rows.append(("gpu", f"the CUDA tests on {card}", tests["summary"], "all pass"))
    base = next(
        (r.get("batches_per_s") for r in gpu.get("rows", []) if r["name"] == "one process"), None
    )
    for row in gpu.get("rows", []):
        if row["name"] == "one process":
            continue
        value = row.get("error") or (
            f"{row['batches_per_s'] / base:.2f}x ({row['batches_per_s']:.0f} batches/s)"
            if base
            else f"{row['batches_per_s']:.0f} batches/s"
        )
        rows.append(
            ("gpu", f"CNN on {card}, {row['name']}, vs one process", value,
             GPU_TARGETS.get(row["name"], ""))
        )  # fmt: skip
    for name, row in (gpu.get("big_model") or {}).get("rows", {}).items():
        if row.get("vs_one_process") is not None and name != "torch":
            rows.append(
                ("gpu", f"BERT-base-sized model on {card}, {name}: {row['what']}, vs one process",
                 f"{row['vs_one_process']:.2f}x ({row['s_per_step']:.3f} s/step)", "")
            )  # fmt: skip
    return rows


def _big_model_headlines(big: dict | None) -> list[tuple[str, str, str, str]]:
    """The cluster runs of the BERT-base-sized model against the one-process loop."""
    if not big:
        return []
    rows = []
    for name, row in big["rows"].items():
        targets = row.get("targets")
        if not targets or "steps_per_s_vs_baseline" not in row:
            continue
        # Against one thread too: on a busy 2-core machine torch's two threads lose most.
        same = row.get("steps_per_s_vs_torch_1thread")
        # And against the plain loop with the fused Adam, the kernel the ps uses by default.
        fused = big["rows"].get("torch_fused")
        against_fused = (
            ""
            if fused is None
            else f"; {fused['s_per_step'] / row['s_per_step']:.2f}x the loop with the fused Adam"
        )
        rows.append(
            (
                "big_model",
                f"{name}: {row['what']}, {big['parameters'] / 1e6:.0f} M parameters, vs "
                f"{big['baseline']}: steps/s; worker peak RSS",
                f"{row['steps_per_s_vs_baseline']:.2f}x ({row['s_per_step']:.2f} s/step"
                + ("" if same is None else f"; {same:.2f}x the one-thread loop")
                + against_fused
                + f"); {row['worker_peak_rss_vs_baseline']:.2f}x "
                f"({row['worker_peak_rss_kib'] / 2**20:.2f} GiB)",
                f">= {targets['steps_per_s']}x; <= {targets['worker_peak_rss']}x",
            )
        )
    return rows


def run_one(name: str, command: list[str]) -> tuple[int, list[str]]:
    """Run one benchmark, its output passed through as it comes; (exit status, its lines)."""
    lines: list[str] = []
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))
    return process.returncode, lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small settings: a smoke test")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), metavar="NAME")
    add_out_dir_option(parser)
    args = parser.parse_args()
    if args.quick and not os.environ.get(OUT_ENV):
        os.environ[OUT_ENV] = tempfile.mkdtemp(prefix="tensorfleet-bench-quick-")
        print(
            f"--quick: results go to {os.environ[OUT_ENV]}, not over the committed tables of "
            "benchmarks/results (pass --out-dir DIR to choose)",
            flush=True,
        )
    info = machine()
    runs, outcomes = {}, {}
    for name, bench in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        arguments = list(bench.quick if args.quick else bench.full)
        command = [sys.executable, str(HERE / f"{bench.script}.py"), *arguments]
        print(f"== {name}: {' '.join(command)}", flush=True)
        started = time.time()
        status, output = run_one(name, command)
        path = results_dir() / f"{bench.results}.json"
        wrote = path.exists() and path.stat().st_mtime >= started
        outcomes[name] = classify(status, output, wrote)
        runs[name] = {
            "command": " ".join(["python", f"benchmarks/{bench.script}.py", *arguments]),
            "exit_status": status,
            "outcome": outcomes[name].kind,
            "reason": outcomes[name].reason,
            "seconds": round(time.time() - started, 1),
        }
        print(f"== {name}: {outcomes[name].kind} {outcomes[name].reason}".rstrip(), flush=True)
    results = {
        name: _load(BENCHMARKS[name].results) if outcomes[name].kind == "ran" else None
        for name in runs
    }
    table = ["| benchmark | figure | value | target | command |", "|---|---|---|---|---|"]
    for bench, figure, value, target in headlines(results):
        table.append(f"| {bench} | {figure} | {value} | {target} | `{runs[bench]['command']}` |")
    for name, run in runs.items():
        if run["outcome"] != "ran":
            reason = run["reason"].replace("|", "\\|")
            table.append(
                f"| {name} | {'skipped' if run['outcome'] == 'skipped' else 'failed'}: {reason} "
                f"| | | `{run['command']}` |"
            )
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    heading = (
        f"`make bench`{' --quick' if args.quick else ''}, {time.strftime('%Y-%m-%d %H:%M')}: "
        f"{info['cpu']} ({info['cpus']} CPUs, {info['memory_gib']} GiB), {info['platform']}, "
        f"Python {info['python']}, {versions}; load average at start "
        f"{', '.join(f'{x:.1f}' for x in info['load_average_at_start'])}"
    )
    write_results("bench", {"machine": info, "runs": runs, "results": results}, heading, table)
    skipped = [name for name, o in outcomes.items() if o.kind == "skipped"]
    failed = [name for name, o in outcomes.items() if o.kind == "failed"]
    print(
        f"{len(runs) - len(skipped) - len(failed)} ran, {len(skipped)} skipped"
        + (f" ({', '.join(skipped)})" if skipped else "")
        + f", {len(failed)} failed"
        + (f" ({', '.join(failed)})" if failed else ""),
        flush=True,
    )
    return exit_status(outcomes)


if __name__ == "__main__":
    raise SystemExit(main())
