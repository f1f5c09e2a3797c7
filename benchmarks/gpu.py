"""The GPU check: the CUDA tests and the GPU rows, in one command on a machine with a GPU.

Parts, each with its own time limit, the results rewritten after each one (so a part that
hangs or a machine that is taken back still leaves what was measured):

1. **tests**: pytest on the test files that touch CUDA (every ``tests/**/test_*.py`` whose
   text mentions ``cuda``), passed / failed / skipped counts and the summary line; the
   ``cpu`` cases of ``test_mode_on_device`` are left out (they start a cluster each and run
   wherever the suite runs; the ``cuda`` cases compare with one CPU process themselves); in
   4 processes where pytest-xdist is installed and the host has 16 cores or more;
2. **transfers**: ``benchmarks/programs/gpu_transfers.py``, the pieces of a GPU worker's
   exchange one at a time for the CNN's 6.5 MB: its gradients off the GPU and its values
   back (one copy per tensor into or out of pageable memory, as today, against one flat
   non-blocking copy through pinned memory), a host copy, the ps's Adam on the CPU by kernel
   and thread count, and one step in one process (60 s at most);
3. **rows**: ``benchmarks/cnn_training.py`` (the example's CNN, Fashion-MNIST) on the GPU,
   steady-state global steps/s from its ``--metrics-json``:

   - one process (the baseline of every ratio, measured in the same run);
   - 1 ps + 1 worker, async; the same with torch's default Adam on the ps, with
     ``--prefetch`` (the round trip behind the next step's compute; this row also writes
     the worker's timeline, summarised as the median milliseconds of each phase: where its
     step goes), and with
     ``--intra-op-threads 4`` and ``1`` (every task's torch threads: where a ps beside a GPU
     worker spends its step);
   - 1 ps + 3 workers sharing one GPU, async;
   - all-reduce, 3 workers sharing one GPU, through shared memory and over gloo
     (``TENSORFLEET_SHARED_MEMORY=0``; NCCL refuses two workers on one GPU);
   - all-reduce, one GPU per worker (NCCL), where the host has 2 or more GPUs;
   - with ``--profile``: 1 ps + 1 worker under ``py-spy record --subprocesses`` (raw stacks
     in ``gpu_profile_1ps_1worker.raw.txt``, each process's top frames in ``.md`` and the
     JSON), to see where the ps's and the worker's time goes.

4. **big model**: ``benchmarks/big_model.py --device cuda --runs torch ps1``: the
   BERT-base-sized encoder (108.5 M parameters, Adam) in one process on the GPU against
   1 ps + 1 worker computing on the GPU (the ps updates in host memory), s/step; its own
   JSON and table in ``big_model_gpu/`` beside this one's.

   The sharing rows run the launcher with ``CUDA_VISIBLE_DEVICES`` set to the first GPU, so
   that its default assignment puts every worker on that one. A global step of all-reduce is
   one batch per worker, so the table gives batches/s too and compares those.

    python benchmarks/gpu.py [--data-dir DIR] [--only tests|transfers|rows|big_model] [--out-dir DIR]

Writes ``gpu.json`` and ``gpu.md`` (the card from ``torch.cuda.get_device_name``). Without a
CUDA GPU it prints ``gpu: not run: <reason>`` and exits with the benchmarks' skip status (77:
``run_all.py`` reports a skip, not a failure). ``scripts/gpu_machine.sh`` prepares a bare GPU
machine (wheels and data carried from here) and runs this.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from results_writer import (  # noqa: E402
    OUT_ENV,
    add_out_dir_option,
    not_run,
    results_dir,
    write_results,
)

NAME = "gpu"
#: The parts, in the order they run.
PARTS = ("tests", "transfers", "rows", "big_model")
#: Seconds each part may take (the tests; each row).
TESTS_LIMIT_S = 240
ROW_LIMIT_S = 100
BIG_MODEL_LIMIT_S = 150
TRANSFERS_LIMIT_S = 60
#: pytest-xdist processes for the tests, where it is installed (and 4 cores for each).
TEST_PROCESSES = 4
#: The row ``--profile`` adds: 1 ps + 1 worker, every process sampled by py-spy.
PROFILED_ROW = "1 ps + 1 worker, async, under py-spy (its figures include the sampling)"
#: Where the profile goes (in the results directory): py-spy's raw stacks, and the top frames.
PROFILE_FILE = "gpu_profile_1ps_1worker"
#: The tests left out here: the CPU cases of the modes (a cluster each; the suite runs them).
SKIPPED_HERE = "not (test_mode_on_device and cpu)"
#: Seconds a part past its limit has to stop its tasks after SIGINT, before SIGKILL.
STOP_GRACE_S = 30
#: Seconds one test may take where pytest-timeout is installed: a test past it is stopped with
#: every thread's stack printed (the ``thread`` method: a hang inside autograd's C++ never
#: returns to Python, where the ``signal`` method would wait), and the other tests go on.
TEST_TIMEOUT_S = 60
#: Where the tests' whole output goes (in the results directory); the JSON keeps its tail.
TESTS_LOG = "gpu_tests.log"


#: Test files that mention CUDA without touching it: the benchmark scripts' tests (which test
#: this check's plumbing on the CPU, and run each script's ``--help`` with no PYTHONPATH, so on
#: a GPU machine whose packages ``gpu_machine.sh`` puts on PYTHONPATH they fail for that
#: reason alone: seen on the H200 machine, 2026-11-27). The CPU suite runs them.
NOT_GPU_TESTS = ("tests/unit/test_benchmark_scripts.py",)


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """The test files that touch CUDA: every ``tests/**/test_*.py`` mentioning ``cuda``, but
    :data:`NOT_GPU_TESTS`."""
    found = [
        str(path.relative_to(root))
        for path in sorted((root / "tests").rglob("test_*.py"))
        if re.search("cuda", path.read_text(), re.IGNORECASE)
        and str(path.relative_to(root)) not in NOT_GPU_TESTS
    ]
    return found


def run_tests(limit_s: float, select: str | None = None) -> dict:
    """pytest on :func:`gpu_test_files` (``select``: a ``-k`` expression narrowing them): its
    counts and summary line, or why it stopped; the whole output in :data:`TESTS_LOG`."""
    files = gpu_test_files()
    command = pytest_command(
        files,
        has_xdist=importlib.util.find_spec("xdist") is not None,
        has_timeout=importlib.util.find_spec("pytest_timeout") is not None,
        select=select,
        has_worksteal=_version_at_least("pytest-xdist", (3, 2)),
    )
    started = time.perf_counter()
    output, status = run_limited(command, _child_env(), limit_s)
    log = results_dir() / TESTS_LOG
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(output)
    lines = [line for line in output.splitlines() if line.strip()]
    summary = next(
        (line for line in reversed(lines) if re.search(r"\d+ (passed|failed)", line)), ""
    )
    counts = {
        kind: int(m.group(1)) if (m := re.search(rf"(\d+) {kind}", summary)) else 0
        for kind in ("passed", "failed", "skipped", "error")
    }
    return {
        "files": files,
        "status": status,
        "seconds": time.perf_counter() - started,
        "summary": summary if status is not None else f"timed out after {limit_s:.0f} s",
        **counts,
        "tail": lines[-80:],
    }


def pytest_command(
    files: list[str],
    has_xdist: bool,
    cpus: int | None = None,
    has_timeout: bool = False,
    select: str | None = None,
    has_worksteal: bool = False,
) -> list[str]:
    """pytest on ``files``, one line per test (``-v``: a part stopped at its limit still says
    which tests passed and which one it was in), in :data:`TEST_PROCESSES` processes where
    pytest-xdist is installed and the host has the cores (each cluster case starts its own
    processes; on 16 cores four at once take a quarter of the time; with ``worksteal``,
    pytest-xdist 3.2 or later, an idle process takes queued tests from a busy one, so the
    cluster cases of one file do not all wait behind each other in one process), each test stopped after :data:`TEST_TIMEOUT_S`
    with every thread's stack where pytest-timeout is installed. ``select`` narrows the tests
    with ``-k`` (the ``cpu`` cases of the modes stay out either way)."""
    expression = SKIPPED_HERE if select is None else f"({SKIPPED_HERE}) and ({select})"
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-k", expression]
    if has_timeout:
        command += ["--timeout", str(TEST_TIMEOUT_S), "--timeout-method", "thread"]
    processes = min(TEST_PROCESSES, (cpus or os.cpu_count() or 1) // 4)
    if has_xdist and processes > 1:
        command += ["-n", str(processes)]
        if has_worksteal:
            command += ["--dist", "worksteal"]
    return [*command, *files]


def _version_at_least(distribution: str, least: tuple[int, ...]) -> bool:
    """Whether ``distribution`` is installed at version ``least`` or later."""
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    numbers = tuple(int(part) for part in re.findall(r"\d+", found)[: len(least)])
    return numbers >= least


def rows_to_run(
    gpus: int, steps: dict[str, int], profile: bool = False, matching: list[str] | None = None
) -> list[dict]:
    """The rows for a host with ``gpus`` GPUs: name, launcher arguments (None: one process),
    worker arguments, whether every worker shares the first GPU; with ``profile``, also
    1 ps + 1 worker under py-spy (:data:`PROFILED_ROW`); with ``matching``, only the rows whose
    name contains one of its texts, and one process (every ratio's baseline)."""
    rows = [
        {"name": "one process", "launch": None, "mode": "async", "steps": steps["one"]},
        {"name": "1 ps + 1 worker, async", "launch": ["--ps", "1", "--workers", "1"],
         "mode": "async", "steps": steps["ps"]},
        # The ps's threads: with the default budget a ps beside one GPU worker gets every
        # core (they take turns), and its update's many small parallel regions then wait on
        # cores the GPU worker's thread holds; the same run with 4 and 1 thread per task says
        # whether that is where a step goes.
        # The ps's Adam in torch's default kernel (the default before 2026-11-27): beside the
        # row above, what the fused kernel changed.
        {"name": "1 ps + 1 worker, async, torch's default Adam kernel (--no-fused-optimizer)",
         "launch": ["--ps", "1", "--workers", "1"], "mode": "async", "steps": steps["ps"],
         "program": ["--no-fused-optimizer"]},
        # The exchange behind the next step's compute (at most one step stale): how much of
        # a GPU worker's step is the round trip it waits for.
        {"name": "1 ps + 1 worker, async, --prefetch",
         "launch": ["--ps", "1", "--workers", "1"], "mode": "async", "steps": steps["ps"],
         "program": ["--prefetch"], "timeline": True},
        {"name": "1 ps + 1 worker, async, --intra-op-threads 4",
         "launch": ["--ps", "1", "--workers", "1", "--intra-op-threads", "4"], "mode": "async",
         "steps": steps["ps"]},
        # The two together: what the exchange behind the compute (its buckets beside each
        # other since 2026-11-28) and the threads give at once.
        {"name": "1 ps + 1 worker, async, --prefetch --intra-op-threads 4",
         "launch": ["--ps", "1", "--workers", "1", "--intra-op-threads", "4"], "mode": "async",
         "steps": steps["ps"], "program": ["--prefetch"]},
        {"name": "1 ps + 1 worker, async, --intra-op-threads 1",
         "launch": ["--ps", "1", "--workers", "1", "--intra-op-threads", "1"], "mode": "async",
         "steps": steps["ps"]},
        {"name": "1 ps + 3 workers sharing one GPU, async",
         "launch": ["--ps", "1", "--workers", "3"], "mode": "async", "steps": steps["ps3"],
         "share": True},
        # Workers sharing a GPU average their gradients through shared memory
        # (worker/host_allreduce.py); the same row over gloo's ring beside it.
        {"name": "all-reduce, 3 workers sharing one GPU (shared memory)",
         "launch": ["--ps", "0", "--workers", "3"], "mode": "allreduce",
         "steps": steps["allreduce"], "share": True},
        {"name": "all-reduce, 3 workers sharing one GPU (gloo: TENSORFLEET_SHARED_MEMORY=0)",
         "launch": ["--ps", "0", "--workers", "3"], "mode": "allreduce",
         "steps": steps["allreduce"], "share": True, "env": {"TENSORFLEET_SHARED_MEMORY": "0"}},
    ]  # fmt: skip
    if profile:
        rows.append(
            {"name": PROFILED_ROW, "launch": ["--ps", "1", "--workers", "1"], "mode": "async",
             "steps": steps["ps"], "profile": True}
        )  # fmt: skip
    if gpus >= 2:
        workers = min(gpus, 8)
        rows.append(
            {
                "name": f"all-reduce, {workers} workers on a GPU each (nccl)",
                "launch": ["--ps", "0", "--workers", str(workers)],
                "mode": "allreduce",
                "steps": steps["allreduce"],
            }
        )
    if matching is not None:
        rows = [row for row in rows if row["launch"] is None
                or any(text in row["name"] for text in matching)]  # fmt: skip
    return rows


def run_row(
    row: dict, data_dir: str | None, first_gpu: str, limit_s: float, device: str = "/gpu:0"
) -> dict:
    """One row: its figures from ``--metrics-json``, or why there are none. (``device``:
    the tests run a row on ``/cpu:0`` to check the plumbing.)"""
    with tempfile.TemporaryDirectory(prefix="tfl-gpu-") as scratch:
        metrics = Path(scratch) / "metrics.json"
        program = (
            [
                sys.executable,
                str(HERE / "cnn_training.py"),
                "--device",
                device,
                "--mode",
                row["mode"],
                "--steps",
                str(row["steps"]),
                "--test-limit",
                "1000",
                "--log-every",
                "1000000",
                "--metrics-json",
                str(metrics),
            ]
            + (["--data-dir", data_dir] if data_dir else [])
            + list(row.get("program", []))
            + (["--timeline", str(Path(scratch) / "trace.json")] if row.get("timeline") else [])
        )
        env = {**_child_env(), **row.get("env", {})}
        if row["launch"] is None:
            command = program
        else:
            command = [sys.executable, "-m", "tensorfleet", "launch", "--no-live"]
            command += [*row["launch"], "--", *program]
            if row.get("share"):
                env["CUDA_VISIBLE_DEVICES"] = first_gpu  # the launcher puts every worker on it
        raw_profile = results_dir() / f"{PROFILE_FILE}.raw.txt"
        if row.get("profile"):
            spy = shutil.which("py-spy")
            if spy is None:
                return {"name": row["name"], "error": "py-spy is not on PATH (pip install py-spy)"}
            raw_profile.parent.mkdir(parents=True, exist_ok=True)
            # Python frames only: py-spy 0.4.3 with --native ended with SIGSEGV on the H200
            # machine (2026-11-27) after the run, leaving no profile.
            command = [spy, "record", "--subprocesses", "--format", "raw",
                       "--rate", "100", "-o", str(raw_profile), "--", *command]  # fmt: skip
        started = time.perf_counter()
        output, status = run_limited(command, env, limit_s)
        result: dict = {
            "name": row["name"],
            "command": " ".join(command[command.index("--") + 1 :] if "--" in command else command),
            "launcher": None if row["launch"] is None else " ".join(row["launch"]),
            "shared_gpu": bool(row.get("share")),
            "status": status,
            "seconds": time.perf_counter() - started,
        }
        if row.get("profile") and raw_profile.exists():
            top = top_frames(raw_profile.read_text())
            (results_dir() / f"{PROFILE_FILE}.md").write_text("\n".join(top) + "\n")
            result["profile"] = {"raw": raw_profile.name, "top": top}
        trace = Path(scratch) / "trace.worker-0.json"
        if row.get("timeline") and trace.exists():
            result["timeline"] = timeline_summary(json.loads(trace.read_text()))
        if status == 0 and metrics.exists():
            figures = json.loads(metrics.read_text())
            result.update(figures)
            per_step = figures["workers"] if figures["mode"] == "allreduce" else 1
            result["batches_per_s"] = figures["steady_global_steps_per_s"] * per_step
        else:
            why = "timed out" if status is None else f"exit status {status}"
            result["error"] = f"{why} after {result['seconds']:.0f} s"
            result["tail"] = [line for line in output.splitlines() if line.strip()][-30:]
        return result


def timeline_summary(trace: dict) -> dict[str, dict[str, float]]:
    """A worker's Chrome trace (``--timeline``) as, per phase (span name, whichever thread
    or track it is on): how many, the median and the total milliseconds; the longest total
    first."""
    durations: dict[str, list[float]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X":
            durations.setdefault(event["name"], []).append(event["dur"] / 1000)
    return {
        name: {
            "count": len(values),
            "median_ms": round(statistics.median(values), 3),
            "total_ms": round(sum(values), 1),
        }
        for name, values in sorted(durations.items(), key=lambda item: -sum(item[1]))
    }


def run_transfers(limit_s: float) -> dict:
    """``benchmarks/programs/gpu_transfers.py`` on the GPU: its figures, or why there are
    none."""
    command = [sys.executable, str(HERE / "programs" / "gpu_transfers.py"), "--device", "cuda"]
    started = time.perf_counter()
    output, status = run_limited(command, _child_env(), limit_s)
    lines = [line for line in output.splitlines() if line.strip()]
    if status == 0 and lines and lines[-1].startswith("{"):
        return json.loads(lines[-1])
    why = "timed out" if status is None else f"exit status {status}"
    return {
        "error": f"{why} after {time.perf_counter() - started:.0f} s",
        "tail": lines[-30:],
    }


def run_big_model(limit_s: float, out_dir: Path) -> dict:
    """``benchmarks/big_model.py`` on the GPU (one process, 1 ps + 1 worker): its rows, or
    why there are none. Its JSON and table go to ``out_dir``."""
    command = [sys.executable, str(HERE / "big_model.py"), "--device", "cuda", "--runs",
               "torch", "ps1", "--steps", "10", "--warmup", "3", "--timeout", str(limit_s)]  # fmt: skip
    env = _child_env()
    env[OUT_ENV] = str(out_dir)
    started = time.perf_counter()
    output, status = run_limited(command, env, limit_s)
    result: dict = {
        "command": " ".join(["python", *command[1:]]),
        "status": status,
        "seconds": time.perf_counter() - started,
    }
    produced = out_dir / "big_model.json"
    if status == 0 and produced.exists():
        rows = json.loads(produced.read_text())["rows"]
        result["rows"] = {
            name: {
                "what": row["what"],
                "s_per_step": row["s_per_step"],
                "vs_one_process": row.get("steps_per_s_vs_baseline"),
                "worker_peak_rss_kib": row["worker_peak_rss_kib"],
            }
            for name, row in rows.items()
        }
    else:
        why = "timed out" if status is None else f"exit status {status}"
        result["error"] = f"{why} after {result['seconds']:.0f} s"
        result["tail"] = [line for line in output.splitlines() if line.strip()][-30:]
    return result


def top_frames(raw: str, count: int = 15) -> list[str]:
    """py-spy's raw stacks (``frame;frame;... samples`` per line; with ``--subprocesses``, a
    child's frames follow its ``process N:"command"`` frame, under its parents') as a markdown
    list per process: its samples and the ``count`` innermost frames holding most of them
    (where its CPU time goes: py-spy leaves idle waits out unless ``--idle``)."""
    by_process: dict[str, dict[str, int]] = {}
    for line in raw.splitlines():
        stack, _, number = line.rpartition(" ")
        if not stack or not number.isdigit():
            continue
        frames = stack.split(";")
        # with --subprocesses a child's stack hangs under its parents' ("process N:...")
        own = max((i for i, frame in enumerate(frames) if frame.startswith("process ")), default=0)
        leaves = by_process.setdefault(frames[own], {})
        leaves[frames[-1]] = leaves.get(frames[-1], 0) + int(number)
    lines = []
    for process, leaves in sorted(by_process.items(), key=lambda item: -sum(item[1].values())):
        total = sum(leaves.values())
        lines.append(f"- {process[:160]}: {total} samples")
        for frame, samples in sorted(leaves.items(), key=lambda item: -item[1])[:count]:
            lines.append(f"  - {100 * samples / total:.1f}% {frame[:160]}")
    return lines


def table(result: dict) -> list[str]:
    """The markdown table: one line for the tests, one per row with its ratio."""
    lines = ["| run | global steps/s | batches/s | vs one process (batches/s) | chief ms per local step |",
             "|---|---|---|---|---|"]  # fmt: skip
    tests = result.get("tests")
    if tests is not None:
        lines.append(f"| GPU tests ({len(tests['files'])} files) | {tests['summary']} | | | |")
    rows = result.get("rows", [])
    base = next((r.get("batches_per_s") for r in rows if r["name"] == "one process"), None)
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['name']} | {row['error']} | | | |")
            continue
        ratio = f"{row['batches_per_s'] / base:.2f}" if base else "n/a"
        lines.append(
            f"| {row['name']} | {row['steady_global_steps_per_s']:.1f} | "
            f"{row['batches_per_s']:.1f} | {ratio} | {row['steady_local_ms_per_step']:.2f} |"
        )
    big = result.get("big_model")
    if big is not None and "error" in big:
        lines.append(f"| BERT-base-sized model (big_model.py) | {big['error']} | | | |")
    for name, row in (big or {}).get("rows", {}).items():
        ratio = "" if row["vs_one_process"] is None else f"{row['vs_one_process']:.2f}"
        lines.append(
            f"| BERT-base-sized model, {name}: {row['what']} | {1 / row['s_per_step']:.2f} | "
            f"{1 / row['s_per_step']:.2f} | {ratio} | {1000 * row['s_per_step']:.0f} |"
        )
    transfers = result.get("transfers")
    if transfers is not None:
        lines += [
            "",
            "| the pieces of the exchange, the CNN's 6.5 MB (transfers) | ms |",
            "|---|---|",
        ]
        if "error" in transfers:
            lines.append(f"| gpu_transfers.py | {transfers['error']} |")
        lines += [
            f"| {name[: -len('_ms')].replace('_', ' ')} | {value:.3f} |"
            for name, value in transfers.items()
            if name.endswith("_ms") and isinstance(value, (int, float))
        ]
    for row in rows:
        if "timeline" in row:
            lines += ["", f"| {row['name']}: worker phase | count | median ms | total ms |",
                      "|---|---|---|---|"]  # fmt: skip
            lines += [
                f"| {name} | {phase['count']} | {phase['median_ms']:.3f} | {phase['total_ms']:.1f} |"
                for name, phase in row["timeline"].items()
            ]
    return lines


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    return env


def run_limited(command: list[str], env: dict[str, str], limit_s: float) -> tuple[str, int | None]:
    """Run ``command`` (output and exit status), or stop it after ``limit_s`` (status None).
    A run past its limit gets SIGINT first (the launcher stops its tasks on it, pytest runs
    its tests' cleanup), then, :data:`STOP_GRACE_S` later, SIGKILL to its process group, so
    that no task is left holding the GPU for the next part."""
    child = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = child.communicate(timeout=limit_s)
        return output, child.returncode
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGINT)
        try:
            output, _ = child.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            output, _ = child.communicate()
        return output + f"\n(stopped after {limit_s:.0f} s)", None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST's four .gz files")
    parser.add_argument("--only", choices=PARTS, nargs="+", default=list(PARTS), metavar="PART",
                        help="the parts to run (tests, transfers, rows, big_model; default all)")  # fmt: skip
    parser.add_argument("--tests-k", default=None, metavar="EXPR",
                        help="a pytest -k expression narrowing the tests")  # fmt: skip
    parser.add_argument("--rows-matching", nargs="+", default=None, metavar="TEXT",
                        help="only the rows whose name contains one of these (and one process, "
                        "every ratio's baseline)")  # fmt: skip
    parser.add_argument("--tests-limit", type=float, default=TESTS_LIMIT_S, metavar="S")
    parser.add_argument("--row-limit", type=float, default=ROW_LIMIT_S, metavar="S")
    parser.add_argument("--big-model-limit", type=float, default=BIG_MODEL_LIMIT_S, metavar="S")
    parser.add_argument("--steps", type=int, default=1500, help="global steps of the ps rows")
    parser.add_argument("--profile", action="store_true",
                        help="also 1 ps + 1 worker under py-spy: where each process's time goes")  # fmt: skip
    add_out_dir_option(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return not_run(
            NAME,
            f"no CUDA GPU here (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
            "torch.cuda.is_available() is False)",
        )
    gpus = torch.cuda.device_count()
    card = torch.cuda.get_device_name(0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    first_gpu = visible.split(",")[0].strip() if visible.strip() else "0"
    result: dict = {
        "card": card,
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    heading = (
        f"# GPU check on {gpus} x {card} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    )

    def save() -> None:
        write_results(NAME, result, heading, table(result))

    if "tests" in args.only:
        print(f"gpu: the CUDA tests ({args.tests_limit:.0f} s at most)", flush=True)
        result["tests"] = run_tests(args.tests_limit, select=args.tests_k)
        save()
    if "transfers" in args.only:
        print(f"gpu: the exchange's pieces ({TRANSFERS_LIMIT_S} s at most)", flush=True)
        result["transfers"] = run_transfers(TRANSFERS_LIMIT_S)
        save()
    if "rows" in args.only:
        steps = {
            "one": 2 * args.steps,
            "ps": args.steps,
            "ps3": args.steps,
            "allreduce": args.steps // 2,
        }
        result["rows"] = []
        for row in rows_to_run(gpus, steps, profile=args.profile, matching=args.rows_matching):
            print(f"gpu: {row['name']} ({args.row_limit:.0f} s at most)", flush=True)
            result["rows"].append(run_row(row, args.data_dir, first_gpu, args.row_limit))
            save()
    if "big_model" in args.only:
        print(f"gpu: the BERT-base-sized model ({args.big_model_limit:.0f} s at most)", flush=True)
        result["big_model"] = run_big_model(args.big_model_limit, results_dir() / "big_model_gpu")
        save()
    failed = (
        ("tests" in result and result["tests"]["status"] != 0)
        or any("error" in row for row in result.get("rows", []))
        or "error" in result.get("big_model", {})
        or "error" in result.get("transfers", {})
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
