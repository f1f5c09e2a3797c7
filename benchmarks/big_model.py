"""A BERT-base-sized model on the cluster against one process: seconds per step and every
task's peak resident memory, for the same model, data and Adam, measured in one run.

The model (``benchmarks/programs/big_model_worker.py``): token and position embeddings,
``--layers`` ``nn.TransformerEncoderLayer`` (hidden ``--hidden``, ``hidden / 64`` heads, FFN
``4 x hidden``), a LayerNorm and a 2-class head on the mean of the sequence (``--head lm``:
an untied LM head over the 30,522-token vocabulary instead); by default BERT-base's shape,
108,523,010 parameters (434 MB of float32), batches of ``--batch`` 4 sequences of ``--seq``
32 uniform random tokens (a pool of 8 from a seeded generator). Adam, lr 1e-4. Runs:

* ``torch``: one process, the plain PyTorch loop with ``torch.optim.Adam`` (torch's default
  threads): **the baseline** every ratio is taken against (``torch_1thread`` when
  ``--runs`` leaves ``torch`` out; no ratio when it leaves both out);
* ``torch_1thread``: the same with one thread (``OMP_NUM_THREADS=1``): what one process
  does on half of this 2-core host (the budget a worker had when the launcher shared the
  cores among all its tasks);
* ``local``: one process, ``tfl.TrainingSession(None, model, tfl.optim.Adam(...))``;
* ``ps1``, ``ps2``: ``python -m tensorfleet launch --ps N --workers 1 -- python
  big_model_worker.py --mode cluster ...``: the real launcher, async mode, every setting at
  its default (prefetch off, the launcher's thread budget, shared memory between the tasks
  of this host). One worker and its ps take turns, so the budget gives the worker every
  core and the ps tasks divide them, and the session's default buckets are off (a bucket's
  update would run on the backward's cores): ``tensorfleet.cluster.thread_budget``;
* ``ps1_shared``: ``ps1`` as it ran before that rule, the cores shared (``--intra-op-threads
  1``) and buckets of 1 MiB during the backward, in the same run for the comparison.

Seconds per step: each program's own clock over the steps after ``--warmup`` (the first
``--warmup`` steps, which include the start, are not timed).

Peak resident memory: while a run goes, this script walks ``/proc`` every 0.2 s for its
process (a one-process run) or the launcher's children (its ps and worker tasks, named from
the ``TF_CONFIG`` in their environment) and reads ``VmHWM`` (and ``VmRSS``, ``RssShmem``)
from ``/proc/<pid>/status``. ``VmHWM`` is the kernel's own high-water mark of the process's
resident set, so sampling it misses no spike between samples, only growth in the last 0.2 s
of a task's life; and it works for the built-in ``tensorfleet server`` ps tasks, which
cannot report on themselves. The worker programs also read their own ``VmHWM`` after
training (exact); a worker's figure is the larger of the two. Shared memory mapped by a task
(``RssShmem``: the same-host payloads) counts in its resident set.

CPU seconds and minor page faults per timed step, of every task: sampled with the memory
(``/proc/<pid>/stat``: ``utime + stime``, ``minflt``) and interpolated to the timed steps'
window (the programs' ``time.perf_counter``, one clock for every process); a worker's CPU
time is its own ``time.process_time()``. CPU time is what a step costs whatever the load (a
shared machine stretches the wall time, not the work); a minor fault is a page touched for
the first time, i.e. fresh memory filled (the price of buffers not reused).

Where the cluster's time goes: every session run records the session's timeline
(``docs/timeline.md``: about a microsecond per span) and the table of phases gives the mean
milliseconds per timed step of each span (``compute``, ``backward``, ``exchange``, and inside
it ``pack``, ``push``, ``wait``, ``unpack``; spans nest, so they do not add up).
``--profile DIR`` also records the ps's side (``tensorfleet server --timeline``: ``receive``,
``apply``, ``reply``) and runs each session's training loop under ``cProfile``
(``DIR/<run>/worker.prof`` and ``.prof.txt``); its step times then include the profiler's
cost, so it is for finding where the time goes, not for the ratios.

    .venv/bin/python benchmarks/big_model.py [--steps 12 --warmup 3] [--runs torch local ps1 ps2]
    .venv/bin/python benchmarks/big_model.py --quick          # a tiny model: a smoke test

Writes benchmarks/results/big_model.json and .md (with ``--quick`` and no ``--out-dir``: into
a new temporary directory, printed, never over the committed table).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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

from results_writer import OUT_ENV, add_out_dir_option, write_results  # noqa: E402

WORKER = HERE / "programs" / "big_model_worker.py"
#: The session's default bucket size (``tensorfleet.worker.push_overlap.DEFAULT_BUCKET_BYTES``).
DEFAULT_BUCKET_BYTES = 1 << 20
#: The runs in the order they go, and what each is.
RUNS = {
    "torch": "one process, plain PyTorch loop, torch.optim.Adam (baseline)",
    "torch_1thread": "one process, plain PyTorch loop, 1 thread",
    "torch_fused": "one process, plain PyTorch loop, torch.optim.Adam(fused=True) (the kernel "
    "the ps's Adam uses by default)",
    "local": "one process, TrainingSession(None, ...)",
    "ps1": "tensorfleet launch --ps 1 --workers 1 (async, defaults)",
    "ps2": "tensorfleet launch --ps 2 --workers 1 (async, defaults)",
    "ps1_shared": "the same as ps1 with the cores shared: --intra-op-threads 1 and "
    "Overlap(bucket_bytes=1 MiB) (the defaults before the turn-taking budget)",
}
#: The run that shows what the turn-taking thread budget changed (in the same run as ps1).
SHARED_CORES = "ps1_shared"
DEFAULT_RUNS = ("torch", "torch_1thread", "local", "ps1", "ps2", "ps1_shared")
#: The one-process run with one thread (half of this 2-core host).
SAME_THREADS = "torch_1thread"
#: Targets of the cluster runs against the baseline: steps/s ratio, worker peak RSS ratio.
STEP_TARGETS = {"ps1": 0.85, "ps2": 0.9}
RSS_TARGET = 1.3
#: --quick's tiny model: a smoke test of the machinery, not a measurement.
QUICK = {"layers": 2, "hidden": 64, "vocab": 1000, "seq": 16, "batch": 4, "steps": 6, "warmup": 2}
#: Seconds between two reads of the tasks' /proc/<pid>/status.
SAMPLE_S = 0.2
#: The worker's spans summarized per timed step (docs/timeline.md), and the ps's.
WORKER_SPANS = ("step", "compute", "backward", "bucket", "exchange", "pack", "push", "wait",
                "unpack")  # fmt: skip
PS_SPANS = ("receive", "apply", "reply")
MEMORY_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssShmem")
GIB = 2**30
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------- memory and CPU of the tasks


def status_kib(pid: int) -> dict[str, int]:
    """``pid``'s :data:`MEMORY_FIELDS` from ``/proc/<pid>/status`` in KiB ({} once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in MEMORY_FIELDS:
            fields[key] = int(value.split()[0])
    return fields


def children_of(parent: int) -> list[int]:
    """The pids whose parent is ``parent`` (from ``/proc/<pid>/stat``, field 4)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        # The command name (field 2) is in parentheses and may hold spaces: split after it.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            found.append(int(entry.name))
    return found


def task_name(pid: int) -> str | None:
    """``ps:0``, ``worker:0``... from the ``TF_CONFIG`` in ``pid``'s environment; None if none."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"TF_CONFIG="):
            task = json.loads(item.split(b"=", 1)[1])["task"]
            return f"{task['type']}:{task['index']}"
    return None


def cpu_and_faults(pid: int) -> tuple[float, float] | None:
    """``pid``'s CPU time so far (user + system, every thread) and its minor page faults (a
    page touched for the first time: fresh memory), or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    # minflt, utime, stime: fields 10, 14 and 15 of proc(5), counted from the state (3).
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, float(fields[7])


def cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """How much a counter (CPU seconds, page faults) grew between ``start`` and ``end``
    (``time.perf_counter``) from ``(perf_counter, count)`` samples, linearly interpolated;
    None without samples on both sides of the window."""

    def at(when: float) -> float | None:
        for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False):
            if t0 <= when <= t1:
                return c0 + (c1 - c0) * ((when - t0) / (t1 - t0) if t1 > t0 else 0.0)
        return None

    first, last = at(start), at(end)
    return None if first is None or last is None else last - first


class TaskSampler:
    """Samples, every :data:`SAMPLE_S` seconds until stopped, a process (``cluster`` False:
    ``pid`` itself, named ``process``) or a launcher's children (each named by its task):
    the peak of its :data:`MEMORY_FIELDS` (``peak[name][field]``, KiB) and its CPU time
    (``cpu[name]``: ``(time.perf_counter(), CPU seconds)`` pairs) and its minor page faults
    (``faults[name]``: ``(time.perf_counter(), faults)`` pairs)."""

    def __init__(self, pid: int, cluster: bool) -> None:
        self.pid, self.cluster = pid, cluster
        self.peak: dict[str, dict[str, int]] = {}
        self.cpu: dict[str, list[tuple[float, float]]] = {}
        self.faults: dict[str, list[tuple[float, float]]] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="task-sampler", daemon=True)

    def __enter__(self) -> TaskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _sample(self) -> None:
        if not self.cluster:
            self._record("process", self.pid)
            return
        for pid in children_of(self.pid):
            if pid not in self.names:
                name = task_name(pid)
                if name is None:
                    continue
                self.names[pid] = name
            self._record(self.names[pid], pid)

    def _record(self, name: str, pid: int) -> None:
        now, counters, status = time.perf_counter(), cpu_and_faults(pid), status_kib(pid)
        if counters is not None:
            self.cpu.setdefault(name, []).append((now, counters[0]))
            self.faults.setdefault(name, []).append((now, counters[1]))
        seen = self.peak.setdefault(name, dict.fromkeys(MEMORY_FIELDS, 0))
        for key, kib in status.items():
            seen[key] = max(seen[key], kib)

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(SAMPLE_S):
                return


# --------------------------------------------------------------------- timelines


def load_events(path: Path) -> list[dict]:
    """The complete (``"ph": "X"``) events of a Chrome-trace file; [] when it is missing."""
    if not path.exists():
        return []
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def phases(worker: list[dict], ps: dict[str, list[dict]], warmup: int) -> dict[str, float]:
    """Mean milliseconds per timed step of each worker span on the stepping thread (the
    ``step`` spans after the first ``warmup``), and of each ps span (``<ps>:<span>``) that
    starts inside a timed step."""
    steps = sorted((e for e in worker if e["name"] == "step"), key=lambda e: e["ts"])[warmup:]
    if not steps:
        return {}
    thread = steps[0]["tid"]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]

    def inside(event: dict) -> bool:
        return any(start <= event["ts"] <= end for start, end in windows)

    totals: dict[str, float] = {}
    for event in worker:
        if event["tid"] == thread and event["name"] in WORKER_SPANS and inside(event):
            totals[event["name"]] = totals.get(event["name"], 0.0) + event["dur"]
    for task, events in ps.items():
        for event in events:
            if event["name"] in PS_SPANS and inside(event):
                key = f"{task}:{event['name']}"
                totals[key] = totals.get(key, 0.0) + event["dur"]
    return {name: total / 1e3 / len(steps) for name, total in totals.items()}


# --------------------------------------------------------------------- one run


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The model, data and loop flags every run's program gets."""
    flags = []
    for option in ("layers", "hidden", "vocab", "seq", "batch", "head", "steps", "warmup", "lr",
                   "device"):  # fmt: skip
        flags += [f"--{option}", str(getattr(args, option))]
    return flags


def run_one(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    """Run ``name`` (a key of :data:`RUNS`); its program's report, plus the sampled memory,
    the phases, the command and the wall time."""
    tmp.mkdir(parents=True, exist_ok=True)
    report = tmp / f"{name}.json"
    program = [sys.executable, str(WORKER), "--report", str(report), *worker_flags(args)]
    profile = args.profile / name if args.profile is not None else None
    timeline = (profile or tmp / name) / "trace.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    if name.startswith("torch"):
        command = [*program, "--mode", "torch"]
        if name == "torch_1thread":
            env["OMP_NUM_THREADS"] = "1"
        if name == "torch_fused":
            command.append("--torch-fused")
    elif name == "local":
        command = [*program, "--mode", "local", "--timeline", str(timeline)]
    else:
        command = [sys.executable, "-m", "tensorfleet", "launch", "--ps", name[2], "--workers",
                   "1", "--no-live"]  # fmt: skip
        if name == SHARED_CORES:
            command += ["--intra-op-threads", "1"]
        if profile is not None:
            command += ["--ps-command", f"{sys.executable} -m tensorfleet server --timeline "
                        f"{timeline}"]  # fmt: skip
        command += ["--", *program, "--mode", "cluster", "--timeline", str(timeline)]
        if name == SHARED_CORES:
            command += ["--bucket-bytes", str(DEFAULT_BUCKET_BYTES)]
    if profile is not None and not name.startswith("torch"):
        command += ["--cprofile", str(profile / "worker.prof")]
    lines: list[str] = []
    started = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def read() -> None:
        """Keep every line (for a failure's report); echo the program's own (its steps)."""
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if "big_model_worker:" in line:
                print(f"  {name}: {lines[-1]}", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sampler = TaskSampler(process.pid, cluster=name.startswith("ps"))
    try:
        with sampler:
            status = process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        status = None
    finally:
        stop(process, list(sampler.names))
    reader.join(timeout=10)
    wall = time.perf_counter() - started
    if status != 0 or not report.exists():
        tail = "\n".join(lines[-60:])
        what = f"exit status {status}" if status is not None else f"no end in {args.timeout} s"
        raise RuntimeError(f"run {name} failed ({what}): {' '.join(command)}\n{tail}")
    result = json.loads(report.read_text())
    tasks = sampler.peak
    if "process" in tasks:
        tasks = {"process": tasks["process"]}
    own = result["memory_kib"]["VmHWM"]
    worker = "process" if "process" in tasks else "worker:0"
    tasks.setdefault(worker, dict.fromkeys(MEMORY_FIELDS, 0))
    tasks[worker]["VmHWM"] = max(tasks[worker]["VmHWM"], own)
    ps_events = {}
    for task in tasks:
        if task.startswith("ps:"):
            ps_events[task] = load_events(timeline.with_name(f"trace.ps-{task[3:]}.json"))
    trace = "trace.local.json" if name == "local" else "trace.worker-0.json"
    window = (result["timed_from_perf_counter_s"], result["started_perf_counter_s"]
              + result["step_ends_s"][-1])  # fmt: skip
    timed = result["steps"] - result["warmup"]
    tasks_cpu = {}
    for task, samples in sampler.cpu.items():
        seconds = cpu_between(samples, *window)
        if seconds is not None:
            tasks_cpu[task] = seconds / timed
    tasks_cpu[worker] = result["cpu_s_per_step"]  # its own clock: exact
    tasks_faults = {}
    for task, samples in sampler.faults.items():
        faults = cpu_between(samples, *window)
        if faults is not None:
            tasks_faults[task] = faults / timed
    result.pop("memory_kib_after_build", None)
    result.update(
        name=name,
        what=RUNS[name],
        command=shown(command, tmp),
        wall_s=wall,
        tasks_memory_kib=tasks,
        worker_peak_rss_kib=tasks[worker]["VmHWM"],
        tasks_cpu_s_per_step=tasks_cpu,
        tasks_minor_faults_per_step=tasks_faults,
        phases_ms=phases(load_events(timeline.with_name(trace)), ps_events, args.warmup),
        load_average_after=os.getloadavg()[0],
    )
    print(
        f"{name}: {result['s_per_step']:.3f} s/step, worker peak RSS "
        f"{result['worker_peak_rss_kib'] / 2**20:.2f} GiB, {wall:.0f} s",
        flush=True,
    )
    return result


def shown(command: list[str], tmp: Path) -> str:
    """``command`` as the results record it: ``python`` for this interpreter, paths in this
    tree relative to it, the run's temporary directory as ``$TMPDIR``."""
    text = " ".join("python" if part == sys.executable else part for part in command)
    text = text.replace(f"{sys.executable} ", "python ").replace(f"{ROOT}/", "")
    return text.replace(str(tmp.parent), "$TMPDIR")


def stop(process: subprocess.Popen, tasks: list[int]) -> None:
    """End ``process`` if it still runs: SIGTERM (the launcher then stops its tasks), then
    SIGKILL to it and to the task pids seen (``tasks``) after 60 s."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for pid in tasks:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        process.kill()
        process.wait(timeout=30)


# --------------------------------------------------------------------- the tables


def _gib(kib: float) -> str:
    return f"{kib / 2**20:.2f} GiB"


def _worker_first(task: str) -> tuple[bool, str]:
    """Sort key: the worker (or the one process) first, then the ps tasks by name."""
    return (task.startswith("ps:"), task)


def summarize(rounds: list[dict[str, dict]], baseline: str | None) -> dict[str, dict]:
    """Each run's medians over the rounds, with the ratios to ``baseline`` (same round)."""
    rows = {}
    for name in rounds[0]:
        points = [r[name] for r in rounds]
        seconds = statistics.median(p["s_per_step"] for p in points)
        rss = max(p["worker_peak_rss_kib"] for p in points)
        row = {
            "what": points[0]["what"],
            "threads": points[0]["threads"],
            "s_per_step": seconds,
            "steps_per_s": 1 / seconds,
            "worker_peak_rss_kib": rss,
            "tasks_memory_kib": points[-1]["tasks_memory_kib"],
            "tasks_minor_faults_per_step": {
                task: statistics.median(
                    p["tasks_minor_faults_per_step"].get(task, 0.0) for p in points
                )
                for task in points[-1]["tasks_minor_faults_per_step"]
            },
            "tasks_cpu_s_per_step": {
                task: statistics.median(p["tasks_cpu_s_per_step"].get(task, 0.0) for p in points)
                for task in points[-1]["tasks_cpu_s_per_step"]
            },
            "loss_first_last": [points[-1]["loss_first"], points[-1]["loss_last"]],
            "phases_ms": points[-1]["phases_ms"],
        }
        if baseline in rounds[0]:
            row["steps_per_s_vs_baseline"] = statistics.median(
                r[baseline]["s_per_step"] / r[name]["s_per_step"] for r in rounds
            )
            row["worker_peak_rss_vs_baseline"] = rss / max(
                r[baseline]["worker_peak_rss_kib"] for r in rounds
            )
        if SAME_THREADS in rounds[0]:
            row[f"steps_per_s_vs_{SAME_THREADS}"] = statistics.median(
                r[SAME_THREADS]["s_per_step"] / r[name]["s_per_step"] for r in rounds
            )
        if name in STEP_TARGETS:
            row["targets"] = {"steps_per_s": STEP_TARGETS[name], "worker_peak_rss": RSS_TARGET}
        rows[name] = row
    return rows


def tables(rows: dict[str, dict], baseline: str | None) -> list[str]:
    """The markdown: the runs, then the phases per timed step."""
    table = [
        f"| run | threads | s/step | steps/s vs {baseline} (target) | vs {SAME_THREADS} | "
        "worker peak RSS | "
        f"vs {baseline} (target) | each ps peak RSS | CPU s/step: worker (+ each ps) | "
        "page faults/step: worker (+ each ps) | loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        speed = row.get("steps_per_s_vs_baseline")
        memory = row.get("worker_peak_rss_vs_baseline")
        targets = row.get("targets", {})
        speed_text = "" if speed is None else f"{speed:.2f}x"
        memory_text = "" if memory is None else f"{memory:.2f}x"
        if targets and speed is not None:
            speed_text += f" (>= {targets['steps_per_s']}x)"
            memory_text += f" (<= {targets['worker_peak_rss']}x)"
        ps = ", ".join(
            f"{task} {_gib(m['VmHWM'])}"
            for task, m in sorted(row["tasks_memory_kib"].items())
            if task.startswith("ps:")
        )
        same = row.get(f"steps_per_s_vs_{SAME_THREADS}")
        same_threads = "" if same is None else f"{same:.2f}x"
        cpu = row["tasks_cpu_s_per_step"]
        cpu_text = " + ".join(f"{cpu[task]:.2f}" for task in sorted(cpu, key=_worker_first))
        faults = row["tasks_minor_faults_per_step"]
        faults_text = " + ".join(
            f"{faults[task] / 1e3:.0f}k" for task in sorted(faults, key=_worker_first)
        )
        first, last = row["loss_first_last"]
        table.append(
            f"| {name}: {row['what']} | {row['threads']} | {row['s_per_step']:.3f} | "
            f"{speed_text} | {same_threads} | {_gib(row['worker_peak_rss_kib'])} | "
            f"{memory_text} | {ps} | "
            f"{cpu_text} | {faults_text} | {first:.3f} -> {last:.3f} |"
        )
    names = [s for s in WORKER_SPANS if any(s in r["phases_ms"] for r in rows.values())]
    ps_names = sorted({k for r in rows.values() for k in r["phases_ms"] if k.startswith("ps:")})
    if names:
        table += [
            "",
            "| run (ms per timed step) | " + " | ".join([*names, *ps_names]) + " |",
            "|---|" + "---|" * (len(names) + len(ps_names)),
        ]
        for name, row in rows.items():
            if row["phases_ms"]:
                cells = [f"{row['phases_ms'].get(s, 0.0):.0f}" for s in [*names, *ps_names]]
                table.append(f"| {name} | " + " | ".join(cells) + " |")
    return table


def too_few_steps(steps: int, warmup: int) -> str | None:
    """What is wrong with ``--steps`` when no step would be timed after the warm-up, or None."""
    if steps > warmup:
        return None
    return (
        f"--steps {steps} is not more than --warmup {warmup}: no step would be timed; pass "
        f"--steps {warmup + 1} or more"
    )


def describe(args: argparse.Namespace) -> str:
    """The model's shape and parameter count (built on torch's meta device: no memory)."""
    import torch

    sys.path.insert(0, str(HERE / "programs"))
    from big_model_worker import Encoder

    heads, ffn = max(1, args.hidden // 64), 4 * args.hidden
    with torch.device("meta"):
        model = Encoder(args.vocab, args.hidden, args.layers, heads, ffn, args.seq, args.head)
    count = sum(p.numel() for p in model.parameters())
    return (
        f"big_model: {args.layers} layers, hidden {args.hidden}, {heads} heads, FFN {ffn}, "
        f"vocabulary {args.vocab}, {args.head} head, batch {args.batch} x {args.seq} tokens: "
        f"{count:,} parameters ({count * 4 / 1e6:.0f} MB of float32)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768, help="heads: hidden / 64, FFN 4x")
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--head", choices=("cls", "lm"), default="cls")
    parser.add_argument("--steps", type=int, default=12, help="steps of every run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--device", default="cpu",
                        help="where the worker (and one process) computes: cpu or cuda")  # fmt: skip
    parser.add_argument("--runs", nargs="+", choices=tuple(RUNS), default=list(DEFAULT_RUNS))
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds (medians)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="also the ps timelines and cProfile of the workers, in DIR")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke test")
    add_out_dir_option(parser)
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        if not os.environ.get(OUT_ENV):  # a smoke test never replaces the committed table
            os.environ[OUT_ENV] = tempfile.mkdtemp(prefix="big-model-quick-")
    problem = too_few_steps(args.steps, args.warmup)
    if problem is not None:
        parser.error(problem)
    if args.repeats < 1:
        parser.error(f"--repeats must be 1 or more, got {args.repeats}")
    if args.profile is not None:
        args.profile = args.profile.resolve()
    runs = [name for name in RUNS if name in args.runs]
    print(describe(args), flush=True)
    # The ratios' baseline: the one-process loop (with torch's threads when it runs); a run of
    # cluster runs alone has none.
    baseline = next((n for n in ("torch", SAME_THREADS) if n in runs), None)
    load_before = os.getloadavg()
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="big-model-") as tmp:
        for index in range(args.repeats):
            rounds.append({})
            for name in runs:
                rounds[-1][name] = run_one(name, args, Path(tmp) / f"round{index}")
    rows = summarize(rounds, baseline)
    first = rounds[0][runs[0]]
    load_after = os.getloadavg()
    result = {
        "benchmark": "BERT-base-sized encoder, Adam, async cluster vs one process",
        "command": " ".join(["python", "benchmarks/big_model.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "shape": first["shape"],
        "parameters": first["parameters"],
        "parameter_bytes": first["parameter_bytes"],
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "baseline": baseline,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "profiled": args.profile is not None,
        "rows": rows,
        "rounds": rounds,
    }
    shape = first["shape"]
    heading = (
        f"{result['benchmark']}: {shape['layers']} layers, hidden {shape['hidden']}, "
        f"{shape['heads']} heads, FFN {shape['ffn']}, vocabulary {shape['vocab']}, "
        f"{shape['head']} head, {first['parameters']:,} parameters "
        f"({first['parameter_bytes'] / 1e6:.0f} MB), batch {shape['batch']} x {shape['seq']} "
        f"tokens, computed on {first.get('device_name', 'cpu')}; "
        f"{args.steps} steps per run, the first {args.warmup} not timed; "
        f"{args.repeats} round(s); {os.cpu_count()} CPUs, load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; {result['date']}"
        + ("; PROFILED (cProfile in the workers): the times include its cost" if args.profile
           else "")
    )  # fmt: skip
    write_results("big_model", result, heading, tables(rows, baseline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
