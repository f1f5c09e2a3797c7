"""Embedding tables on the ps: bytes on the wire and time per step, rows vs the whole table.

Every run is a local cluster of 2 ps and 1 worker (``benchmarks/programs/sparse_table_worker.py``:
an embedding of ``rows`` x 64 and a linear head, SGD, async, batches of ``--batch`` ids drawn
uniformly, so about that many unique rows per step). Runs:

* ``sparse_1M``: a ``tfl.EmbeddingTable(1M, 64)``: each step pulls the batch's unique rows
  and pushes their gradient;
* ``dense_1M``: the same table as a dense ``nn.Embedding(1M, 64)`` parameter, pulled and
  pushed whole every step (what the table is for avoiding);
* ``sparse_10M``: a table 10 times larger, the same batches: bytes follow the unique ids,
  not the table size;
* ``mirrored_1M``: ``nn.Embedding(1M, 64, sparse=True)``: the ps holds its weight as rows,
  each step pushes the touched rows' gradient and pulls the rows changed since the last
  pull into the worker's whole copy (before, such a weight was a dense variable and moved
  like ``dense_1M``);
* ``big`` (``--big-rows``, default 20M x 64 = 5.1 GB of fp32): every row created on the 2 ps
  before training (``--precreate``, shard after shard), then ``--big-steps`` steps; the
  worker's and the ps's resident memory are measured.

Bytes are counted by the worker's transport (``ParameterClient.wire_bytes``: every request
and reply to the shards, headers and payloads), per step over the measured steps. The ps's
resident memory is sampled from ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``) while it runs.
The first three runs go in ``--repeats`` interleaved rounds (medians; ratios within a
round). Shared memory between worker and ps is off (``TENSORFLEET_SHARED_MEMORY=0``): the
bytes go over TCP as between hosts.

Two more parts (``--parts tables click growing``, all by default):

* ``click``: the click model of ``examples/click_fm.py`` (a factorization machine, one
  1M x 8 table) on a fixed data set of ``--click-examples`` examples, ``--click-epochs``
  epochs of batches of 256 (``programs/click_speed.py``), for each optimizer
  (``--click-optimizers``: adagrad, sparse_adam, sgd) seven runs side by side in each round
  (``--click-modes``: all by default; ``torch`` always):
  a plain PyTorch loop (``nn.Embedding(sparse=True)`` and torch's optimizer), a one-process
  ``TrainingSession`` with a ``tfl.EmbeddingTable``, the same with every row created before
  the loop (``EmbeddingTable.create_all_rows()``, as the plain loop's ``nn.Embedding``
  initializes its weight before it; ``--rows-ahead``), and the same session as 2 ps + 2
  workers (async), without and with each step's lookup sent ahead with the step before's
  exchange (``cluster_prefetch``: ``EmbeddingTable.prefetch``, ``--prefetch``), each also
  with every row created on the ps shards before the loop (``cluster_ahead``,
  ``cluster_ahead_prefetch``: every worker calls ``create_all_rows()``; the plain loop's
  table is whole before its loop too); with ``--baseline-src DIR``, also ``cluster_baseline``:
  2 ps + 2 workers running the package in ``DIR`` (another checkout's ``src``), an A/B of a
  change in the same rounds. Reported: examples/s over the training loops, the workers' CPU seconds, the
  held-out AUC, and per round the ratios to the plain loop (examples/s; one process also
  CPU seconds, the measure a loaded machine disturbs least);
* ``growing``: a raw-id table (``ids="raw"``) whose ids arrive over time (half of each batch
  of ``--growing-batch`` ids new), ``--growing-steps`` steps with no expiry and with
  ``expire_after_steps=--growing-expire``: rows live and the 2 ps's resident memory halfway
  and after the last step.

    .venv/bin/python benchmarks/sparse_tables.py [--repeats 3] [--big-rows 20000000]
    .venv/bin/python benchmarks/sparse_tables.py --parts click --click-examples 200000

Writes benchmarks/results/sparse_tables.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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

WORKER = HERE / "programs" / "sparse_table_worker.py"
CLICK = HERE / "programs" / "click_speed.py"
CLICK_MODES = (
    "torch", "local", "local_ahead", "cluster", "cluster_prefetch", "cluster_ahead",
    "cluster_ahead_prefetch",
)  # fmt: skip
CLICK_OPTIMIZERS = ("adagrad", "sparse_adam", "sgd")
PARTS = ("tables", "click", "growing")
GIB = 2**30
MARK = "sparse_tables: "  # a worker's line starting so: the driver reads the ps's memory


class Capture(Output):
    """Keeps the last lines of every task, for the error message of a failed run; when the
    worker prints a :data:`MARK` line (``sparse_tables: trained``, ``... halfway``), reads the
    ps's resident memory at once (``ps_rss_kib[label]``; ``trained_ps_rss_kib``: what the ps
    hold while serving the trained table)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.cluster: LocalCluster | None = None
        self.ps_rss_kib: dict[str, dict[str, int]] = {}

    @property
    def trained_ps_rss_kib(self) -> dict[str, int]:
        return self.ps_rss_kib.get("trained", {})

    def line(self, task: str, text: str) -> None:
        self.lines = [*self.lines[-200:], f"[{task}] {text}"]
        if text.startswith(MARK) and self.cluster is not None:
            label = text[len(MARK) :].strip()
            self.ps_rss_kib[label] = {
                name: _status_kib(pid).get("VmRSS", 0)
                for name, pid in self.cluster.pids.items()
                if name.startswith("ps")
            }


def _status_kib(pid: int) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


class PsMemory:
    """Samples the ps processes' VmRSS and VmHWM every ``interval_s`` until stopped:
    ``peak`` (each ps's highest), ``peak_total_rss_kib`` (the highest sum of the ps's VmRSS
    at one instant)."""

    def __init__(self, cluster: LocalCluster, interval_s: float = 0.25) -> None:
        self.cluster, self.interval_s = cluster, interval_s
        self.peak: dict[str, dict[str, int]] = {}
        self.peak_total_rss_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PsMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            total = 0
            for name, pid in self.cluster.pids.items():
                if not name.startswith("ps"):
                    continue
                seen = self.peak.setdefault(name, {"VmRSS": 0, "VmHWM": 0})
                status = _status_kib(pid)
                for key, kib in status.items():
                    seen[key] = max(seen[key], kib)
                if "VmRSS" in status:
                    total += status["VmRSS"]
            self.peak_total_rss_kib = max(self.peak_total_rss_kib, total)


def run(name: str, worker_args: list[str], timeout_s: float) -> dict:
    """One cluster of 2 ps and 1 worker; the worker's report plus the ps memory."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        command = [sys.executable, str(WORKER), str(out), *worker_args]
        capture = Capture()
        cluster = LocalCluster(
            2,
            1,
            command,
            output=capture,
            grace_period=30,
            env={"PYTHONPATH": str(ROOT / "src"), "TENSORFLEET_SHARED_MEMORY": "0"},
        )
        capture.cluster = cluster
        started = time.perf_counter()
        try:
            cluster.start()
            with PsMemory(cluster) as memory:
                code = cluster.wait(timeout=timeout_s)
        finally:
            cluster.stop()
        if code != 0 or not out.exists():
            tail = "\n".join(capture.lines[-40:])
            raise RuntimeError(f"run {name} failed (exit status {code}):\n{tail}")
        report = json.loads(out.read_text())
    report["ps_memory_kib"] = memory.peak
    report["ps_peak_total_rss_kib"] = memory.peak_total_rss_kib
    report["ps_trained_rss_kib"] = capture.trained_ps_rss_kib
    report["ps_rss_kib_at"] = capture.ps_rss_kib
    report["wall_s"] = time.perf_counter() - started
    print(name, json.dumps(report), flush=True)
    return report


def run_click(
    mode: str,
    optimizer: str,
    examples: int,
    epochs: int,
    timeout_s: float,
    src: Path = ROOT / "src",
) -> dict:
    """The click model (``programs/click_speed.py``) trained ``epochs`` times over
    ``examples`` examples: by a plain PyTorch loop (``torch``), a one-process session
    (``local``) or 2 ps + 2 workers (``cluster``, async), every process running the package
    in ``src``. Returns examples/s over the training loops (cluster: all the workers'
    examples over the span from the first start to the last end), their CPU seconds, the
    held-out AUC."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        extra = (["--rows-ahead"] if "_ahead" in mode else []) + (
            ["--prefetch"] if mode.endswith("_prefetch") else []
        )
        program_mode = mode.split("_")[0]
        if program_mode == "cluster":  # each worker reports its step's phases
            extra += ["--timeline", str(Path(tmp) / "traces")]
        command = [sys.executable, str(CLICK), str(out), "--mode", program_mode,
                   "--optimizer", optimizer, "--examples", str(examples), "--epochs",
                   str(epochs), *extra]  # fmt: skip
        env = {"PYTHONPATH": str(src)}
        if program_mode == "cluster":
            capture = Capture()
            cluster = LocalCluster(2, 2, command, output=capture, grace_period=30, env=env)
            try:
                cluster.start()
                code = cluster.wait(timeout=timeout_s)
            finally:
                cluster.stop()
            reports = [Path(f"{out}.{rank}") for rank in range(2)]
            if code != 0 or not all(r.exists() for r in reports):
                tail = "\n".join(capture.lines[-40:])
                raise RuntimeError(f"click {mode} {optimizer} failed (exit {code}):\n{tail}")
            parts = [json.loads(r.read_text()) for r in reports]
        else:
            done = subprocess.run(
                command, env={**os.environ, **env}, capture_output=True, text=True,
                timeout=timeout_s, check=False,
            )  # fmt: skip
            if done.returncode != 0 or not out.exists():
                raise RuntimeError(
                    f"click {mode} {optimizer} failed (exit {done.returncode}):\n"
                    f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
                )
            parts = [json.loads(out.read_text())]
    span = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    report = {
        "mode": mode,
        "optimizer": optimizer,
        "examples": sum(p["examples"] for p in parts),
        "seconds": span,
        "examples_per_s": sum(p["examples"] for p in parts) / span,
        "cpu_s_workers": sum(p["cpu_s"] for p in parts),
        "auc": next(p["auc"] for p in parts if "auc" in p),
        "setup_cpu_s": sum(p.get("setup_cpu_s", 0.0) for p in parts),
    }
    phases = [p["phases"] for p in parts if "phases" in p]
    if phases:  # the workers' mean, per step
        report["phases"] = {k: statistics.mean(p[k] for p in phases) for k in phases[0]}
    print("click", json.dumps(report), flush=True)
    return report


def _count(rows: int) -> str:
    """1000000 -> 1M, 100000 -> 100k."""
    for unit, size in (("M", 10**6), ("k", 10**3)):
        if rows >= size and rows % size == 0:
            return f"{rows // size}{unit}"
    return str(rows)


def _gb(kib: float) -> str:
    return f"{kib * 1024 / 1e9:.2f} GB"


def measure_tables(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """The table runs (``sparse_*``, ``dense_*``, ``mirrored_*``, ``big``): the results'
    fields and the markdown table."""
    common = ["--dim", "64", "--batch", str(args.batch)]
    sparse, dense = f"sparse_{_count(args.rows)}", f"dense_{_count(args.rows)}"
    sparse_10x = f"sparse_{_count(10 * args.rows)}"
    mirrored = f"mirrored_{_count(args.rows)}"
    configs = {
        sparse: ["--kind", "sparse", "--rows", str(args.rows), "--steps", str(args.sparse_steps)],
        dense: ["--kind", "dense", "--rows", str(args.rows), "--steps", str(args.dense_steps),
                "--warmup", "2"],
        sparse_10x: ["--kind", "sparse", "--rows", str(10 * args.rows),
                     "--steps", str(args.sparse_steps)],
        mirrored: ["--kind", "mirrored", "--rows", str(args.rows),
                   "--steps", str(args.sparse_steps)],
    }  # fmt: skip
    rounds: list[dict[str, dict]] = []
    for _ in range(args.repeats):
        rounds.append({name: run(name, [*extra, *common], 900) for name, extra in configs.items()})
    big = None
    if args.big_rows:
        big = run(
            "big",
            ["--kind", "sparse", "--rows", str(args.big_rows), "--steps", str(args.big_steps),
             "--precreate", *common],
            3000,
        )  # fmt: skip

    def median(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rounds)

    def bytes_of(report: dict) -> float:
        return report["sent_bytes_per_step"] + report["received_bytes_per_step"]

    def ratio(top: str, bottom: str, of) -> float:
        return statistics.median(of(r[top]) / of(r[bottom]) for r in rounds)

    rows = {}
    for name in configs:
        rows[name] = {
            "table_rows": rounds[0][name]["rows"],
            "unique_ids_per_step": median(name, "unique_ids_per_step"),
            "wire_bytes_per_step": statistics.median(bytes_of(r[name]) for r in rounds),
            "sent_bytes_per_step": median(name, "sent_bytes_per_step"),
            "received_bytes_per_step": median(name, "received_bytes_per_step"),
            "step_ms_median": median(name, "step_ms_median"),
            "start_s_median": median(name, "start_s"),
            "worker_peak_rss_kib": max(r[name]["memory_kib"]["VmHWM"] for r in rounds),
            "ps_peak_rss_kib": max(r[name]["ps_peak_total_rss_kib"] for r in rounds),
            "ps_trained_rss_kib": max(sum(r[name]["ps_trained_rss_kib"].values()) for r in rounds),
            "loss_before_after": [rounds[-1][name]["loss_before"], rounds[-1][name]["loss_after"]],
        }
    ratios = {
        f"{dense}_vs_{sparse}_bytes": ratio(dense, sparse, bytes_of),
        f"{dense}_vs_{sparse}_step_time": ratio(dense, sparse, lambda r: r["step_ms_median"]),
        f"{sparse_10x}_vs_{sparse}_bytes": ratio(sparse_10x, sparse, bytes_of),
        f"{sparse_10x}_vs_{sparse}_step_time": ratio(
            sparse_10x, sparse, lambda r: r["step_ms_median"]
        ),
        f"{dense}_vs_{mirrored}_bytes": ratio(dense, mirrored, bytes_of),
        f"{dense}_vs_{mirrored}_step_time": ratio(dense, mirrored, lambda r: r["step_ms_median"]),
        f"{mirrored}_vs_{sparse}_bytes": ratio(mirrored, sparse, bytes_of),
        f"{mirrored}_vs_{sparse}_step_time": ratio(mirrored, sparse, lambda r: r["step_ms_median"]),
    }
    table = [
        "| run | table | unique ids/step | bytes/step (sent + received) | ms/step median | "
        "session start s | worker peak RSS | 2 ps: peak RSS together | "
        "2 ps: RSS after the last step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        table.append(
            f"| {name} | {row['table_rows']:,} x 64 | {row['unique_ids_per_step']:.0f} | "
            f"{row['wire_bytes_per_step'] / 1e6:.3f} MB | {row['step_ms_median']:.1f} | "
            f"{row['start_s_median']:.1f} | "
            f"{_gb(row['worker_peak_rss_kib'])} | {_gb(row['ps_peak_rss_kib'])} | "
            f"{_gb(row['ps_trained_rss_kib'])} |"
        )
    if big is not None:
        big_ps = big["ps_memory_kib"]
        big["table_bytes"] = args.big_rows * 64 * 4
        big["ps_peak_rss_kib_each"] = {name: ps["VmHWM"] for name, ps in big_ps.items()}
        table.append(
            f"| big (every row created) | {args.big_rows:,} x 64 ({big['table_bytes'] / 1e9:.2f} "
            f"GB) | {big['unique_ids_per_step']:.0f} | "
            f"{(big['sent_bytes_per_step'] + big['received_bytes_per_step']) / 1e6:.3f} MB | "
            f"{big['step_ms_median']:.1f} | {big['start_s']:.1f} | "
            f"{_gb(big['memory_kib']['VmHWM'])} | "
            f"{_gb(big['ps_peak_total_rss_kib'])} | {_gb(sum(big['ps_trained_rss_kib'].values()))} |"
        )
    table += [
        "",
        "| ratio (median of same-round ratios) | value |",
        "|---|---|",
        *(f"| {k} | {v:.2f}x |" for k, v in ratios.items()),
    ]
    fields = {"batch_ids": args.batch, "rows": rows, "ratios": ratios, "big": big, "rounds": rounds}
    heading = (
        f"Tables: 2 ps + 1 worker, async SGD, batches of {args.batch} uniform ids, dim 64 fp32, "
        "shared memory off (TCP); bytes counted by the worker's transport"
    )
    return fields, [heading, "", *table]


def measure_click(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """The click model against a plain PyTorch loop, each optimizer in every round: rows
    (examples/s, the held-out AUC) and the ratios to the plain loop of the same round."""
    rounds: list[dict[str, dict]] = []
    for _ in range(args.repeats):
        one = {}
        for optimizer in args.click_optimizers:
            for mode in args.click_modes:
                src = args.baseline_src if mode.endswith("_baseline") else ROOT / "src"
                one[f"{mode}_{optimizer}"] = run_click(
                    mode, optimizer, args.click_examples, args.click_epochs, 1800, src
                )
        rounds.append(one)
    rows, ratios = {}, {}
    for optimizer in args.click_optimizers:
        for mode in args.click_modes:
            name = f"{mode}_{optimizer}"
            rows[name] = {
                "examples_per_s": statistics.median(r[name]["examples_per_s"] for r in rounds),
                "seconds": statistics.median(r[name]["seconds"] for r in rounds),
                "cpu_s_workers": statistics.median(r[name]["cpu_s_workers"] for r in rounds),
                "auc": statistics.median(r[name]["auc"] for r in rounds),
                "setup_cpu_s": statistics.median(r[name]["setup_cpu_s"] for r in rounds),
            }
            if "phases" in rounds[0][name]:
                rows[name]["phases"] = {
                    k: statistics.median(r[name]["phases"][k] for r in rounds)
                    for k in rounds[0][name]["phases"]
                }
            if mode != "torch":
                ratios[f"click_{name}_vs_torch_{optimizer}"] = statistics.median(
                    r[name]["examples_per_s"] / r[f"torch_{optimizer}"]["examples_per_s"]
                    for r in rounds
                )
            if mode.startswith("local"):  # one process each: CPU seconds are the load-proof measure
                ratios[f"click_{name}_vs_torch_{optimizer}_cpu"] = statistics.median(
                    r[f"torch_{optimizer}"]["cpu_s_workers"] / r[name]["cpu_s_workers"]
                    for r in rounds
                )
    label = {"torch": "plain PyTorch loop", "local": "tensorfleet, one process",
             "local_ahead": "tensorfleet, one process, rows created ahead",
             "cluster": "tensorfleet, 2 ps + 2 workers (async)",
             "cluster_prefetch": "tensorfleet, 2 ps + 2 workers (async), next rows ahead",
             "cluster_ahead": "tensorfleet, 2 ps + 2 workers (async), rows created ahead",
             "cluster_ahead_prefetch": "tensorfleet, 2 ps + 2 workers (async), rows created "
             "ahead, next rows ahead",
             "cluster_baseline": f"tensorfleet of {args.baseline_src}, 2 ps + 2 workers "
             "(async)"}  # fmt: skip
    table = [
        "| run | optimizer | examples/s | loop s | CPU s (workers) | held-out AUC | examples/s "
        "vs plain PyTorch | CPU s: plain PyTorch / this | a worker's step, ms: forward "
        "(lookup's wait) + backward + exchange |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for optimizer in args.click_optimizers:
        for mode in args.click_modes:
            row = rows[f"{mode}_{optimizer}"]
            ratio = ratios.get(f"click_{mode}_{optimizer}_vs_torch_{optimizer}", 1.0)
            cpu = ratios.get(f"click_{mode}_{optimizer}_vs_torch_{optimizer}_cpu")
            cpu_cell = "1.00x" if mode == "torch" else "" if cpu is None else f"{cpu:.2f}x"
            phases = row.get("phases")
            step = (
                f"{phases['forward_ms']:.2f} ({phases['lookup_wait_ms']:.2f}) + "
                f"{phases['backward_ms']:.2f} + {phases['exchange_ms']:.2f}"
                if phases
                else ""
            )
            table.append(
                f"| {label[mode]} | {optimizer} | {row['examples_per_s']:,.0f} | "
                f"{row['seconds']:.2f} | {row['cpu_s_workers']:.2f} | {row['auc']:.4f} | "
                f"{ratio:.2f}x | {cpu_cell} | {step} |"
            )
    heading = (
        f"Click model (examples/click_fm.py's factorization machine, 1M x 8 table): "
        f"{args.click_examples:,} examples x {args.click_epochs} epochs, batches of 256"
    )
    fields = {"click_rows": rows, "click_ratios": ratios, "click_rounds": rounds}
    return fields, [heading, "", *table]


def measure_growing(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """A raw-id table whose ids arrive over time (half of each batch new), with and without
    eviction: rows live and the ps's resident memory halfway and after the last step."""
    steps, batch = args.growing_steps, args.growing_batch
    capacity = steps * batch  # room for every id the run brings, so only expiry bounds it
    base = ["--kind", "growing", "--rows", str(capacity), "--steps", str(steps), "--dim", "64",
            "--batch", str(batch)]  # fmt: skip
    configs = {
        "growing_no_expiry": base,
        f"growing_expire_{args.growing_expire}": [
            *base, "--expire-after-steps", str(args.growing_expire),
        ],
    }  # fmt: skip
    rounds = [{name: run(name, extra, 900) for name, extra in configs.items()}]
    table = [
        "| run | ids seen | rows live halfway | rows live at the end | 2 ps: RSS halfway | "
        "2 ps: RSS after the last step | 2 ps: peak RSS together | ms/step median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = {}
    for name in configs:
        report = rounds[0][name]
        at = report["ps_rss_kib_at"]
        rows[name] = {
            "ids_seen": (steps + 5 + 1) * batch // 2,
            "rows_live_halfway": report["rows_live_halfway"],
            "rows_live": report["rows_live"],
            "ps_rss_halfway_kib": sum(at.get("halfway", {}).values()),
            "ps_rss_end_kib": sum(at.get("trained", {}).values()),
            "ps_peak_rss_kib": report["ps_peak_total_rss_kib"],
            "step_ms_median": report["step_ms_median"],
        }
        row = rows[name]
        table.append(
            f"| {name} | {row['ids_seen']:,} | {row['rows_live_halfway']:,} | "
            f"{row['rows_live']:,} | {_gb(row['ps_rss_halfway_kib'])} | "
            f"{_gb(row['ps_rss_end_kib'])} | {_gb(row['ps_peak_rss_kib'])} | "
            f"{row['step_ms_median']:.1f} |"
        )
    heading = (
        f"Growing raw-id table (ids='raw', 64 fp32, async SGD, 2 ps + 1 worker): {steps} steps "
        f"of {batch} ids, half of them new each step; capacity {capacity:,} rows (never full)"
    )
    return {"growing_rows": rows, "growing_rounds": rounds}, [heading, "", *table]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which runs (default: all)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1_000_000, help="the table of the comparison")
    parser.add_argument("--batch", type=int, default=1024, help="ids per step")
    parser.add_argument("--sparse-steps", type=int, default=100)
    parser.add_argument("--dense-steps", type=int, default=10)
    parser.add_argument("--big-rows", type=int, default=20_000_000, help="0: no big run")
    parser.add_argument("--big-steps", type=int, default=300)
    parser.add_argument(
        "--click-examples", type=int, default=1_000_000, help="the click runs' data set"
    )
    parser.add_argument("--click-epochs", type=int, default=2)
    parser.add_argument(
        "--click-modes", nargs="+", choices=CLICK_MODES, default=list(CLICK_MODES),
        help="the click part's runs (the plain PyTorch loop, torch, always runs)",
    )  # fmt: skip
    parser.add_argument(
        "--click-optimizers", nargs="+", choices=CLICK_OPTIMIZERS, default=list(CLICK_OPTIMIZERS)
    )
    parser.add_argument("--growing-steps", type=int, default=300)
    parser.add_argument("--growing-batch", type=int, default=8192, help="ids per step")
    parser.add_argument("--growing-expire", type=int, default=50)
    parser.add_argument(
        "--baseline-src", type=Path,
        help="click: also run 2 ps + 2 workers with the package in DIR (another checkout's "
        "src), in the same rounds (cluster_baseline): an A/B of a change",
    )  # fmt: skip
    add_out_dir_option(parser)
    args = parser.parse_args()
    args.click_modes = ["torch", *(m for m in CLICK_MODES[1:] if m in args.click_modes)]
    if args.baseline_src is not None:
        if not (args.baseline_src / "tensorfleet" / "__init__.py").is_file():
            parser.error(
                f"--baseline-src {args.baseline_src}: no tensorfleet package there; give the "
                "src directory of another checkout (e.g. git clone -q . /tmp/before && git -C "
                "/tmp/before checkout -q COMMIT, then --baseline-src /tmp/before/src)"
            )
        args.click_modes.append("cluster_baseline")
    result: dict = {
        "benchmark": "embedding tables: rows vs the dense table, the click model against "
        "plain PyTorch, a growing raw-id table",
        "command": " ".join(["python", "benchmarks/sparse_tables.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "repeats": args.repeats,
        "parts": args.parts,
        "ratios": {},
    }
    lines: list[str] = []
    measures = {"tables": measure_tables, "click": measure_click, "growing": measure_growing}
    for part in args.parts:
        fields, table = measures[part](args)
        ratios = {**result["ratios"], **fields.pop("ratios", {}), **fields.get("click_ratios", {})}
        result.update(fields)
        result["ratios"] = ratios
        lines += [*([""] if lines else []), *table]
    heading = (
        f"{result['benchmark']}; medians of {args.repeats} interleaved rounds, {result['date']}"
    )
    write_results("sparse_tables", result, heading, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
