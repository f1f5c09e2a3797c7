"""Chaos run: SIGKILL a random task every 15-30 s while the CNN trains, under the launcher's
default settings, and check that training shrugs it off.

A 1 ps + 3 worker cluster (``LocalCluster`` with its default restart policy, the built-in ps
with its default settings) trains ``examples/mnist_cnn.py`` with checkpoints. Every 15-30 s
(uniformly at random, ``--seed``) one task chosen at random among the running ones, the ps
and the chief included, is killed with SIGKILL, ten kills in all. Then the same command runs
undisturbed (the baseline, same steps). The run passes when:

- the disturbed run exits 0 with its test accuracy line,
- its test accuracy is within 0.01 of the undisturbed run's,
- every checkpoint left in its directory verifies (manifest, sizes, SHA-256),
- no process of either run is left (every pid any task ever had is gone).

The report gives each kill: the task, the global step at the kill, the seconds until the
task was back (a worker: its first global step after the restart; the ps: the first global
step anyone made after its restart), and the steps lost (the global step at the kill
minus the first one after the recovery, 0 when training never went back: the steps
since the last checkpoint for a ps kill).

    .venv/bin/python benchmarks/chaos.py [--steps 10000] [--kills 10] [--seed 5]

Kills land only while training runs (before the last step and the chief's accuracy line);
a run that ends before the last kill fails the "kills during training" check and says to
pass more ``--steps``.

**Storm mode** (``--storm``): mixed faults at a fixed interval for a fixed time, under the
launcher's default settings (one warm spare, the default restart policy). Every ``--interval``
seconds (10) for ``--duration`` seconds (600) one running task chosen at random, the ps and
the chief included, gets one of SIGKILL, SIGTERM (a preemption) or SIGSTOP followed by
SIGCONT ``--stop-seconds`` (15) later (``--faults``). Before the storm the run trains
``--calm`` seconds (60) undisturbed. The report: each fault's recovery (seconds from the fault
to the victim's next step line: a worker's own step after its restart or its SIGCONT; for the
ps, anyone's step after it; for a stop, counted from its SIGCONT, as the stop itself is the
storm's), p50 / p95 / max by fault and job (a worker's kill or term split by whether a warm
spare took it over); global steps per minute during
the storm against before it; the final test accuracy against an undisturbed run of the same
steps (``--no-baseline`` skips it); and the processes still running after the end (every pid
any task or spare ever had). It passes when the run exits 0 with its accuracy line, within
``--tolerance`` of the undisturbed run, every fault recovered and nothing is left running.

    .venv/bin/python benchmarks/chaos.py --storm --steps 40000 [--interval 10] [--duration 600]

A storm that outlasts training fails the "storm during training" check and says to pass
more ``--steps``. Writes ``chaos_storm`` (``chaos_storm_seed<N>`` for a seed other than 5;
``--results-name NAME`` writes ``NAME`` instead, in either mode).

Writes benchmarks/results/chaos.json and .md for the default seed (5: the run whose table
the docs cite) and ``chaos_seed<N>.json`` and ``.md`` for any other seed, so that a run with
another seed never replaces that table (``--out-dir`` puts them elsewhere); exits 1 when a
check fails. Takes about
(steps / steps-per-second) twice: a few minutes per run on a small machine. Measured under
whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_writer import add_out_dir_option, write_results  # noqa: E402
from silent_worker_dumps import SILENT_S, SilentWorkerDumps  # noqa: E402
from storm_outages import percentile, split_table  # noqa: E402

from tensorfleet import environment  # noqa: E402
from tensorfleet.errors import CheckpointError, LaunchError  # noqa: E402
from tensorfleet.launch import update_log_directory  # noqa: E402
from tensorfleet.launch.local_cluster import LocalCluster  # noqa: E402
from tensorfleet.launch.output import PlainOutput  # noqa: E402
from tensorfleet.launch.warm_spares import DEFAULT_PS_SPARES, DEFAULT_SPARES  # noqa: E402
from tensorfleet.session.checkpoints import CheckpointDirectory, read_checkpoint  # noqa: E402

EXAMPLE = ROOT / "examples" / "mnist_cnn.py"
STEP_LINE = re.compile(r"^Worker: (\d+), Step: (\d+)")
ACCURACY_LINE = re.compile(r"^Test accuracy: (\d\.\d+)")
STALE_DROP_LINE = re.compile(r"dropped (worker:\d+)'s push: .* on values (\d+) updates old")
TASKS = ("ps:0", "worker:0", "worker:1", "worker:2")
#: The seed of the run whose table is ``benchmarks/results/chaos.md`` (docs/reliability.md
#: cites it); every other seed writes ``chaos_seed<N>``.
DEFAULT_SEED = 5
#: Seconds a kill's recovery is awaited before it is reported as not recovered.
RECOVERY_LIMIT_S = 300.0


@dataclass
class Kill:
    """One SIGKILL and what followed."""

    task: str
    at_s: float  # seconds since the start of the run
    global_step: int  # the global step at the kill (Watch.current_step)
    recovered_s: float | None = None  # kill -> the task back (see the module docstring)
    first_step_after: int | None = None
    steps_lost: int | None = None


@dataclass
class Watch(PlainOutput):
    """The run's log (to a file), and the global steps seen, with when and by whom."""

    log_path: Path
    echo: bool = False
    steps: list[tuple[float, int, int]] = field(default_factory=list)  # (time, worker, step)
    restarted: dict[str, list[float]] = field(default_factory=dict)
    accuracy: float | None = None
    spare_pids: list[int] = field(default_factory=list)
    #: py-spy dumps of workers silent during a storm (:mod:`silent_worker_dumps`)
    silent_dumps: list[dict] = field(default_factory=list)
    #: (time, task, pid) of each restart, and whether a warm spare took it over
    restarts: list[tuple[float, str, int, bool]] = field(default_factory=list)
    #: (time, task or "launcher", text) of every line, for the phases of a ps's recovery
    events: list[tuple[float, str, str]] = field(default_factory=list)
    #: (time, worker, age) of each push a ps dropped as too old (tensorfleet.ps.gradient_age)
    stale_drops: list[tuple[float, str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._file = self.log_path.open("w")
        super().__init__(self._file, self._file)
        self._watch_lock = threading.Lock()

    def line(self, task: str, text: str) -> None:
        super().line(task, text)
        if self.echo:
            print(f"[{task}] {text}", flush=True)
        with self._watch_lock:
            self.events.append((time.monotonic(), task, text))
        if match := STEP_LINE.match(text):
            with self._watch_lock:
                self.steps.append((time.monotonic(), int(match.group(1)), int(match.group(2))))
        if task == "worker:0" and (match := ACCURACY_LINE.match(text)):
            self.accuracy = float(match.group(1))
        if task.startswith("ps:") and (match := STALE_DROP_LINE.search(text)):
            with self._watch_lock:
                self.stale_drops.append((time.monotonic(), match.group(1), int(match.group(2))))

    def message(self, text: str, level: str = "info") -> None:
        super().message(text, level)
        print(f"[launcher] {text.splitlines()[0]}", flush=True)
        with self._watch_lock:
            self.events.append((time.monotonic(), "launcher", text))
        if match := re.match(r"restarted (\S+) .* as pid (\d+)", text):
            with self._watch_lock:
                self.restarted.setdefault(match.group(1), []).append(time.monotonic())
                self.restarts.append(
                    (time.monotonic(), match.group(1), int(match.group(2)), "warm spare" in text)
                )
        if match := re.match(r"started warm spare \S+ for the \w+( tasks)? as pid (\d+)", text):
            self.spare_pids.append(int(match.group(2)))

    def current_step(self) -> int:
        """The global step now: the highest seen since the latest ps restart (the global
        step goes back only when a restarted ps is restored from a checkpoint)."""
        with self._watch_lock:
            since = max(self.restarted.get("ps:0", [0.0]))
            after = [step for t, _, step in self.steps if t > since]
            return max(after or [step for _, _, step in self.steps] or [0])

    def last_step_time(self, worker: int) -> float | None:
        """When ``worker`` (its index) printed its latest step line, or None."""
        with self._watch_lock:
            return max((t for t, w, _ in self.steps if w == worker), default=None)

    def steps_since(self, t: float) -> list[tuple[float, int, int]]:
        with self._watch_lock:
            return [s for s in self.steps if s[0] > t]

    def training_over(self, steps: int) -> bool:
        """True once the last step was made or the chief printed its test accuracy."""
        return self.accuracy is not None or self.current_step() >= steps

    def close_log(self) -> None:
        self._file.close()


def example_command(args: argparse.Namespace, logdir: Path) -> list[str]:
    return [
        sys.executable, str(EXAMPLE), "--steps", str(args.steps), "--log-every", "1",
        "--logdir", str(logdir), "--checkpoint-steps", str(args.checkpoint_steps),
        "--progress-secs", "10", "--seed", str(args.seed),
        *(["--max-gradient-age", args.max_gradient_age] if args.max_gradient_age else []),
    ]  # fmt: skip


@contextmanager
def update_log_env(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """What ``tensorfleet launch`` sets for the tasks of one run with ``--ps-update-log``'s
    value (a directory, ``off``, or by default ``auto``: a new directory of the run in
    ``/dev/shm``, removed when the run ends), as the launcher chooses it."""
    chosen = update_log_directory.choose(args.ps_update_log, "local")
    try:
        path = "" if chosen.path is None else str(chosen.path)
        yield {environment.PS_UPDATE_LOG_VAR: path}
    finally:
        chosen.remove()


def run(
    args: argparse.Namespace, workdir: Path, name: str, kills: int, log_env: dict[str, str]
) -> tuple[int, Watch, list[Kill], list[int], float]:
    """Run the cluster, killing ``kills`` random tasks, with ``log_env`` (the update log's
    variable, :func:`update_log_env`); (status, watch, kills, pids, seconds)."""
    logdir = workdir / name
    watch = Watch(workdir / f"{name}.log", echo=args.echo)
    spares = args.spares if kills else 0  # the launcher's default for the disturbed run
    ps_spares = args.ps_spares if kills else 0
    cluster = LocalCluster(
        1,
        3,
        example_command(args, logdir),
        output=watch,
        spares=spares,
        ps_spares=ps_spares,
        env=log_env,
    )
    rng = random.Random(args.seed)
    done: list[Kill] = []
    status: list[int] = []

    def supervise() -> None:
        status.append(cluster.wait())

    started = time.monotonic()
    cluster.start()
    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    try:
        while len(done) < kills and supervisor.is_alive():
            supervisor.join(rng.uniform(args.min_interval, args.max_interval))
            if not supervisor.is_alive():
                break
            if watch.training_over(args.steps):
                # Kills are chaos *during* training; a kill after the last step tests the
                # launcher's end of run, which tests/e2e cover on their own.
                print("chaos: training is over; no more kills", flush=True)
                break
            running = [t for t in cluster.tasks if t.running and not t.restart_pending]
            candidates = [t.name for t in running if t.name in args.targets]
            if not candidates:
                continue
            victim = rng.choice(candidates)
            kill = Kill(victim, time.monotonic() - started, watch.current_step())
            try:
                cluster.kill_task(victim, signal.SIGKILL)
            except LaunchError as exc:  # it ended by itself meanwhile (training over)
                print(f"chaos: not killing {victim}: {exc}", flush=True)
                continue
            done.append(kill)
            print(f"chaos: SIGKILL {victim} at global step {kill.global_step}", flush=True)
        supervisor.join(args.timeout)
        if supervisor.is_alive():
            cluster.interrupt(signal.SIGTERM)
            supervisor.join(60)
    finally:
        cluster.stop()
        watch.close_log()
    elapsed = time.monotonic() - started
    for kill in done:
        measure_recovery(kill, started, watch)
    pids = [pid for t in cluster.tasks for pid in [t.pid, *t.previous_pids] if pid is not None]
    return (status[0] if status else -1), watch, done, pids, elapsed


def measure_recovery(kill: Kill, started: float, watch: Watch) -> None:
    """Fill in when the killed task was back and the steps lost."""
    killed_at = started + kill.at_s
    restarts = [t for t in watch.restarted.get(kill.task, []) if t > killed_at]
    if not restarts:
        return
    restarted_at = restarts[0]
    after = watch.steps_since(restarted_at)
    if kill.task.startswith("worker:"):
        index = int(kill.task.split(":")[1])
        after = [s for s in after if s[1] == index]
    if not after:
        return
    t, _, step = after[0]
    kill.recovered_s = t - killed_at
    kill.first_step_after = step
    if kill.task.startswith("ps:"):
        # The first global step after the ps's restart: the restored checkpoint's step + 1
        # (1 when there was no checkpoint yet and the chief re-created the variables).
        kill.steps_lost = max(0, kill.global_step + 1 - step)
    else:
        # A worker's death takes only its own step in flight; training goes on, so the
        # lowest global step anyone made until the worker was back shows whether anything
        # was lost (later ps kills are their own rows).
        lowest_after = min(s for when, _, s in watch.steps_since(killed_at) if when <= t)
        kill.steps_lost = max(0, kill.global_step + 1 - lowest_after)


def verify_checkpoints(directory: Path) -> tuple[int, list[str]]:
    """(number of checkpoints, the errors of those that do not verify)."""
    errors = []
    found = CheckpointDirectory(directory).step_directories()
    for _, path in found:
        try:
            read_checkpoint(path)
        except CheckpointError as exc:
            errors.append(str(exc))
    return len(found), errors


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def results_name(seed: int) -> str:
    """The results' file name of a run with ``seed``: ``chaos`` for the default seed (the
    committed table), ``chaos_seed<N>`` for any other, so no seed overwrites another's."""
    return "chaos" if seed == DEFAULT_SEED else f"chaos_seed{seed}"


# ---------------------------------------------------------------------- storm mode

#: The faults of a storm, by the name ``--faults`` takes.
FAULTS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}


@dataclass
class Fault:
    """One fault of a storm and what followed."""

    task: str
    kind: str  # kill, term, stop
    at_s: float  # seconds since the start of the run
    global_step: int
    resumed_at_s: float | None = None  # stop: when SIGCONT was sent
    recovered_s: float | None = None  # the fault -> the victim's next step (module docstring)
    spare: bool | None = None  # kill/term: the task was taken over by a warm spare
    #: stop: the launcher replaced the stopped task before its SIGCONT (a ps stopped past
    #: ``--replace-stopped-ps``); its recovery is then timed from the stop, as a kill's
    replaced: bool = False
    #: kill/term of the ps: the highest global step seen before its restart, + 1, minus the
    #: first one after (what the restore from the newest checkpoint gave back)
    steps_lost: int | None = None
    #: kill/term of the ps: seconds from the fault to each phase of its recovery (PS_PHASES);
    #: term of a worker: the same with WORKER_TERM_PHASES
    phases: dict[str, float] = field(default_factory=dict)


#: The phases of a ps's recovery, in order: the name, who says it, and the start of the line
#: that marks its end (the launcher saw the old process end, restarted the task; the new
#: process listens; a shard is restored or re-created; the workers said they recovered).
PS_PHASES = (
    ("exited", "launcher", "ps:0 failed with"),
    ("restarted", "launcher", "restarted ps:0"),
    ("listening", "ps:0", "ps:0: opened for"),
    ("restored", "ps:0", "ps:0: restored from a checkpoint"),
    ("workers recovered", "worker:", "recovered"),
)


def ps_phases(watch: Watch, at: float, until: float) -> dict[str, float]:
    """Seconds from a ps fault at ``at`` to the first line of each of :data:`PS_PHASES`
    before ``until`` (the first step after it); a phase with no line is left out. "workers
    recovered" is the last worker's "recovered" line (a restore without a checkpoint, which
    re-creates the shard, has no "restored" line)."""
    with watch._watch_lock:
        events = [e for e in watch.events if at < e[0] <= until]
    phases: dict[str, float] = {}
    for name, who, start in PS_PHASES:
        if name == "workers recovered":
            recovered = {
                task: t
                for t, task, text in events
                if task.startswith(who) and text.startswith(f"{task}: {start}")
            }
            if recovered:
                phases[name] = max(recovered.values()) - at
            continue
        found = [t for t, task, text in events if task == who and text.startswith(start)]
        if found:
            phases[name] = found[0] - at
    return phases


#: The phases of a worker's recovery from SIGTERM, in order: the name, and how the line that
#: marks its end starts (``{task}`` filled in; the launcher's lines, except "saved"): the
#: worker finished its step (and, the chief, wrote its checkpoint) and is about to leave; the
#: launcher scheduled its restart (at its exit, or once it left: launch/preempted_handover.py);
#: the launcher restarted it.
WORKER_TERM_PHASES = (
    ("saved", "{task}: preempted (SIGTERM)"),
    ("restart scheduled", ("{task} failed with", "{task} left the cluster")),
    ("restarted", "restarted {task} "),
)


def worker_term_phases(watch: Watch, task: str, at: float, until: float) -> dict[str, float]:
    """Seconds from a worker SIGTERM at ``at`` to the first line of each of
    :data:`WORKER_TERM_PHASES` before ``until`` (its first step after it)."""
    with watch._watch_lock:
        events = [e for e in watch.events if at < e[0] <= until]
    phases: dict[str, float] = {}
    for name, starts in WORKER_TERM_PHASES:
        who = task if name == "saved" else "launcher"
        prefixes = tuple(
            p.format(task=task) for p in (starts if isinstance(starts, tuple) else (starts,))
        )
        found = [t for t, by, text in events if by == who and text.startswith(prefixes)]
        if found:
            phases[name] = found[0] - at
    return phases


def step_lines_between(watch: Watch, start: float, end: float) -> int:
    """Global steps made between ``start`` and ``end`` (one step line per step made)."""
    with watch._watch_lock:
        return sum(1 for t, _, _ in watch.steps if start <= t < end)


def storm_run(
    args: argparse.Namespace, workdir: Path, log_env: dict[str, str]
) -> tuple[int, Watch, list[Fault], list[int], dict[str, float]]:
    """The disturbed run: calm, then the storm, then training to its end (``log_env``: the
    update log's variable, :func:`update_log_env`)."""
    logdir = workdir / "storm"
    watch = Watch(workdir / "storm.log", echo=args.echo)
    cluster = LocalCluster(
        1,
        3,
        example_command(args, logdir),
        output=watch,
        spares=args.spares,
        ps_spares=args.ps_spares,
        env=log_env,
    )  # the launcher's defaults otherwise: restart policy, grace periods
    rng = random.Random(args.seed)
    faults: list[Fault] = []
    status: list[int] = []
    stopped: dict[str, tuple[threading.Timer, Fault]] = {}  # SIGSTOPped, awaiting SIGCONT
    resumed: dict[str, float] = {}  # task -> when its latest SIGCONT came
    times: dict[str, float] = {}
    dumps = SilentWorkerDumps()

    def silent_workers() -> dict[str, tuple[int, float]]:
        """Each worker that should be making steps: its pid and seconds without one (none
        while the ps is stopped or restarting, or once training is over)."""
        ps = cluster.task("ps:0")
        if "ps:0" in stopped or ps.restart_pending or not ps.running:
            return {}
        if watch.training_over(args.steps):
            return {}
        now, found = time.monotonic(), {}
        for task in cluster.tasks:
            name = task.name
            if not name.startswith("worker:") or not task.running or task.restart_pending:
                continue
            if name in stopped or task.pid is None:
                continue
            since = max(
                watch.last_step_time(int(name.split(":")[1])) or started,
                *watch.restarted.get(name, [started]),
                *watch.restarted.get("ps:0", [started]),
                resumed.get(name, started),
                resumed.get("ps:0", started),
            )
            found[name] = (task.pid, now - since)
        return found

    def supervise() -> None:
        status.append(cluster.wait())

    def resume(name: str, fault: Fault) -> None:
        task = cluster.task(name)
        if task.process is not None:
            task.process.signal_group(signal.SIGCONT)
        fault.resumed_at_s = time.monotonic() - started
        resumed[name] = time.monotonic()
        stopped.pop(name, None)

    started = time.monotonic()
    times["run_start"] = started
    cluster.start()
    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    try:
        deadline = started + args.timeout
        while not watch.steps and supervisor.is_alive() and time.monotonic() < deadline:
            supervisor.join(0.5)
        times["calm_start"] = time.monotonic()
        dumps.start(silent_workers)
        supervisor.join(args.calm)
        times["storm_start"] = time.monotonic()
        storm_end = times["storm_start"] + args.duration
        print(
            f"chaos: storm for {args.duration:g} s, a fault every {args.interval:g} s", flush=True
        )
        next_fault = times["storm_start"] + args.interval
        while supervisor.is_alive() and next_fault <= storm_end:
            supervisor.join(max(0.0, next_fault - time.monotonic()))
            next_fault += args.interval
            if not supervisor.is_alive():
                break
            if watch.training_over(args.steps):
                print(
                    f"chaos: training is over {time.monotonic() - times['storm_start']:.0f} s "
                    f"into the {args.duration:g} s storm; pass more --steps",
                    flush=True,
                )
                break
            running = [
                t.name
                for t in cluster.tasks
                if t.running and not t.restart_pending and t.name not in stopped
            ]
            candidates = [name for name in running if name in args.targets]
            if not candidates:
                continue
            victim, kind = rng.choice(candidates), rng.choice(args.faults)
            fault = Fault(victim, kind, time.monotonic() - started, watch.current_step())
            try:
                cluster.kill_task(victim, FAULTS[kind])
            except LaunchError as exc:  # it ended by itself meanwhile
                print(f"chaos: not signalling {victim}: {exc}", flush=True)
                continue
            if kind == "stop":
                timer = threading.Timer(args.stop_seconds, resume, (victim, fault))
                stopped[victim] = (timer, fault)
                timer.start()
            faults.append(fault)
            print(f"chaos: {kind} {victim} at global step {fault.global_step}", flush=True)
        times["storm_end"] = time.monotonic()
        for name, (timer, fault) in list(stopped.items()):  # resume what is still stopped
            timer.cancel()
            resume(name, fault)
        supervisor.join(args.timeout)
        if supervisor.is_alive():
            cluster.interrupt(signal.SIGTERM)
            supervisor.join(60)
    finally:
        dumps.stop()
        for name, (timer, fault) in list(stopped.items()):
            timer.cancel()
            resume(name, fault)
        cluster.stop()
        watch.close_log()
    times["end"] = time.monotonic()
    watch.silent_dumps = dumps.dumps
    for fault in faults:
        measure_storm_recovery(fault, started, watch)
    pids = [pid for t in cluster.tasks for pid in [t.pid, *t.previous_pids] if pid is not None]
    pids += watch.spare_pids
    return (status[0] if status else -1), watch, faults, pids, times


def measure_storm_recovery(fault: Fault, started: float, watch: Watch) -> None:
    """Seconds from ``fault`` (a stop: from its SIGCONT) to the victim's next step: a
    worker's own step after its restart (kill, term) or its SIGCONT; for the ps, anyone's
    step after those. A stopped task the launcher replaced before its SIGCONT (a ps stopped
    past ``--replace-stopped-ps``) is timed as a kill: from the stop to the first step after
    its restart."""
    at = started + fault.at_s
    if fault.kind == "stop":
        if fault.resumed_at_s is None:
            return
        back = started + fault.resumed_at_s
        replaced = [r for r in watch.restarts if r[1] == fault.task and at < r[0] < back]
        if replaced:
            fault.replaced, back, fault.spare = True, replaced[0][0], replaced[0][3]
    else:
        restarts = [r for r in watch.restarts if r[1] == fault.task and r[0] > at]
        if not restarts:
            return
        back = restarts[0][0]
        fault.spare = restarts[0][3]
    after = watch.steps_since(back)
    timed_from_fault = fault.kind != "stop" or fault.replaced
    if fault.task.startswith("ps:") and timed_from_fault and after:
        before = [step for t, _, step in watch.steps_since(at) if t <= back]
        fault.steps_lost = max(0, max([fault.global_step, *before]) + 1 - after[0][2])
    if fault.task.startswith("worker:"):
        index = int(fault.task.split(":")[1])
        after = [s for s in after if s[1] == index]
    if after:
        # a stop's own seconds are the storm's, not the recovery's: counted from SIGCONT,
        # unless the launcher replaced the stopped task (then from the stop, as a kill)
        fault.recovered_s = after[0][0] - (at if timed_from_fault else back)
        if fault.task.startswith("ps:") and timed_from_fault:
            fault.phases = {**ps_phases(watch, at, after[0][0]), "first step": fault.recovered_s}
        elif fault.kind == "term":
            phases = worker_term_phases(watch, fault.task, at, after[0][0])
            fault.phases = {**phases, "first step": fault.recovered_s}


def write_timeline(watch: Watch, faults: list[Fault], start: float, path: Path) -> None:
    """Every line of the disturbed run and every fault, in order, with the seconds since
    ``start`` (the storm's log file has the lines without their times): where a slow
    recovery's seconds went, e.g. the chief's lines between a ps's restart and its restore."""
    entries = [(at, task, text.splitlines()[0] if text else "") for at, task, text in watch.events]
    entries += [(start + f.at_s, "storm", f"{f.kind} {f.task}") for f in faults]
    with path.open("w") as file:
        for at, task, text in sorted(entries, key=lambda entry: entry[0]):
            file.write(f"{at - start:9.3f} [{task}] {text}\n")
    print(f"chaos: the disturbed run's lines with their times: {path}", flush=True)


def storm_main(args: argparse.Namespace, workdir: Path) -> int:
    """The storm, the undisturbed run, the checks and the report."""
    with update_log_env(args) as log_env:
        status, watch, faults, pids, times = storm_run(args, workdir, log_env)
    write_timeline(watch, faults, times["run_start"], workdir / "storm-timeline.txt")
    base_accuracy = None
    base_status: int | None = None
    if not args.no_baseline:
        with update_log_env(args) as log_env:
            base_status, base_watch, _, base_pids, _ = run(args, workdir, "baseline", 0, log_env)
        base_accuracy = base_watch.accuracy
        pids += base_pids + base_watch.spare_pids
    time.sleep(1.0)  # SIGKILL is delivered asynchronously; give the kernel a moment
    left = sorted({pid for pid in pids if alive(pid)})
    calm_min = (times["storm_start"] - times["calm_start"]) / 60
    storm_min = (times["storm_end"] - times["storm_start"]) / 60
    before = step_lines_between(watch, times["calm_start"], times["storm_start"]) / calm_min
    during = step_lines_between(watch, times["storm_start"], times["storm_end"]) / storm_min
    groups: dict[str, list[float]] = {}
    for fault in faults:
        job = fault.task.split(":")[0]
        key = f"{fault.kind} {job}"
        if fault.kind == "stop" and fault.replaced:
            key += " (replaced)"
        if fault.kind != "stop" or fault.replaced:
            key += " (spare)" if fault.spare else " (fresh process)"
        if fault.recovered_s is not None:
            groups.setdefault(key, []).append(fault.recovered_s)
    summary = {
        key: {
            "n": len(v),
            "p50_s": percentile(v, 0.5),
            "p95_s": percentile(v, 0.95),
            "max_s": max(v),
        }
        for key, v in sorted(groups.items())
    }
    storm_ok = times["storm_end"] - times["storm_start"] >= args.duration - args.interval
    checks = {
        "exit status 0": status == 0,
        "test accuracy line": watch.accuracy is not None,
        "the storm ran its whole duration during training": storm_ok,
        "every fault recovered": all(f.recovered_s is not None for f in faults),
        "no process left": not left,
    }
    if not args.no_baseline:
        checks[f"accuracy within {args.tolerance} of the undisturbed run"] = (
            watch.accuracy is not None
            and base_accuracy is not None
            and abs(watch.accuracy - base_accuracy) <= args.tolerance
        )
    result = {
        "mode": "storm",
        "steps": args.steps,
        "seed": args.seed,
        "interval_s": args.interval,
        "duration_s": args.duration,
        "stop_seconds": args.stop_seconds,
        "faults_allowed": args.faults,
        "spares": args.spares,
        "ps_spares": args.ps_spares,
        "exit_status": status,
        "test_accuracy": watch.accuracy,
        "baseline_exit_status": base_status,
        "baseline_test_accuracy": base_accuracy,
        "steps_per_min_before": before,
        "steps_per_min_during": during,
        "during_vs_before": during / before if before else None,
        "recovery": summary,
        "faults": [asdict(f) for f in faults],
        "processes_left": left,
        "silent_worker_dumps": watch.silent_dumps,
        "max_gradient_age": args.max_gradient_age or "auto",
        "stale_pushes_dropped": [
            {"at_s": t - times["run_start"], "worker": w, "age": a} for t, w, a in watch.stale_drops
        ],
        "checks": checks,
    }
    table = [
        "| fault | n | p50 (s) | p95 (s) | max (s) |",
        "|---|---|---|---|---|",
    ]
    table += [
        f"| {key} | {v['n']} | {v['p50_s']:.1f} | {v['p95_s']:.1f} | {v['max_s']:.1f} |"
        for key, v in summary.items()
    ]
    unrecovered = [f"{f.kind} {f.task} at {f.at_s:.0f} s" for f in faults if f.recovered_s is None]
    lost = [
        f"{f.kind} at step {f.global_step}: {f.steps_lost}"
        for f in faults
        if f.steps_lost is not None
    ]
    accuracy = (
        f"test accuracy {watch.accuracy} (undisturbed run: {base_accuracy})"
        if not args.no_baseline
        else f"test accuracy {watch.accuracy} (no undisturbed run: --no-baseline)"
    )
    table += [
        "",
        f"{len(faults)} faults; global steps per minute {before:.0f} before the storm, "
        f"{during:.0f} during it (**{during / before if before else 0:.2f}x**); {accuracy}; "
        f"exit {status}; {len(left)} process(es) left"
        + (f"; not recovered: {', '.join(unrecovered)}" if unrecovered else "")
        + (f"; global steps lost by the ps faults: {', '.join(lost)}" if lost else ""),
        "",
        f"Lines in which the ps said it dropped pushes computed on values too old "
        f"(max_gradient_age={args.max_gradient_age or 'auto'}; at most one line per worker per "
        f"10 s, so a line may stand for several buckets of one step): {len(watch.stale_drops)}"
        + (
            f", ages {', '.join(str(a) for _, _, a in watch.stale_drops)} updates"
            if watch.stale_drops
            else ""
        ),
        "",
    ]
    phased = [f for f in faults if f.phases and f.task.startswith("ps:")]
    if phased:
        table += [
            "Where each ps fault's recovery went (seconds from the fault to the end of each "
            "phase):",
            "",
            "| fault | at step | "
            + " | ".join(name for name, _, _ in PS_PHASES)
            + " | first step |",
            "|---|---|" + "---|" * (len(PS_PHASES) + 1),
        ]
        table += [
            f"| {f.kind} {f.task} | {f.global_step} | "
            + " | ".join(
                f"{f.phases[name]:.1f}" if name in f.phases else ""
                for name in [*(n for n, _, _ in PS_PHASES), "first step"]
            )
            + " |"
            for f in phased
        ]
        table.append("")
    terms = [f for f in faults if f.phases and f.task.startswith("worker:")]
    if terms:
        names = [name for name, _ in WORKER_TERM_PHASES] + ["first step"]
        table += [
            "Where each worker SIGTERM's recovery went (seconds from the SIGTERM to the end of "
            "each phase):",
            "",
            "| fault | at step | " + " | ".join(names) + " |",
            "|---|---|" + "---|" * len(names),
        ]
        table += [
            f"| {f.kind} {f.task} | {f.global_step} | "
            + " | ".join(f"{f.phases[n]:.1f}" if n in f.phases else "" for n in names)
            + " |"
            for f in terms
        ]
        table.append("")
    table += [
        "Worker recoveries split by whether their ps was out at the time (a worker makes no "
        "step while its ps is stopped or restarting; `benchmarks/storm_outages.py`):",
        "",
        *split_table(result["faults"], args.stop_seconds),
        "",
    ]
    if watch.silent_dumps:
        dumped = ", ".join(
            f"{d['task']} (pid {d['pid']}, {d['silent_s']:.0f} s)" for d in watch.silent_dumps
        )
        table += [
            f"Workers without a step line for {SILENT_S:g} s or more while nothing of the storm "
            f"held them, dumped with py-spy (their stacks: `silent_worker_dumps` in the JSON): "
            f"{dumped}",
            "",
        ]
    table += [f"- [{'x' if ok else ' '}] {name}" for name, ok in checks.items()]
    heading = (
        f"Storm: 1 ps + 3 workers, {args.steps} steps, {'/'.join(args.faults)} on a random task "
        f"every {args.interval:g} s for {args.duration:g} s (SIGSTOP for {args.stop_seconds:g} s; "
        f"seed {args.seed}; {args.spares} warm spare worker(s), {args.ps_spares} warm spare "
        "ps), default launcher settings otherwise; "
        "measured under whatever else the machine ran"
    )
    name = args.results_name or (
        "chaos_storm" if args.seed == DEFAULT_SEED else f"chaos_storm_seed{args.seed}"
    )
    write_results(name, result, heading, table)
    return 0 if all(checks.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=10000,
        help="global steps of each run: enough that ten kills 15-30 s apart land while it trains",
    )
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--min-interval", type=float, default=15.0, help="seconds")
    parser.add_argument("--max-interval", type=float, default=30.0, help="seconds")
    parser.add_argument("--checkpoint-steps", type=int, default=200)
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help=f"the kills' schedule (default {DEFAULT_SEED}: writes chaos.md; others chaos_seedN.md)",
    )
    parser.add_argument(
        "--targets", nargs="+", default=list(TASKS), help="tasks that may be killed"
    )
    parser.add_argument("--tolerance", type=float, default=0.01, help="accuracy difference")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--echo", action="store_true", help="print every task line")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary one")
    storm = parser.add_argument_group("storm mode")
    storm.add_argument(
        "--storm", action="store_true", help="mixed faults at a fixed interval (see above)"
    )
    storm.add_argument("--interval", type=float, default=10.0, help="seconds between faults")
    storm.add_argument("--duration", type=float, default=600.0, help="seconds of the storm")
    storm.add_argument("--calm", type=float, default=60.0, help="seconds measured before the storm")
    storm.add_argument(
        "--faults",
        nargs="+",
        choices=sorted(FAULTS),
        default=["kill", "term", "stop"],
        help="the faults drawn from (default: all three)",
    )
    storm.add_argument(
        "--stop-seconds", type=float, default=15.0, help="SIGSTOP lasts this long, then SIGCONT"
    )
    storm.add_argument(
        "--spares",
        type=int,
        default=DEFAULT_SPARES,
        help=f"warm spare workers of the disturbed run, in both modes (default "
        f"{DEFAULT_SPARES}: tensorfleet launch's default)",
    )
    storm.add_argument(
        "--ps-spares",
        type=int,
        default=DEFAULT_PS_SPARES,
        help=f"warm spare ps processes of the disturbed run, in both modes (default "
        f"{DEFAULT_PS_SPARES}: tensorfleet launch's default)",
    )
    parser.add_argument(
        "--ps-update-log",
        default=None,
        metavar="DIR|auto|off",
        help="where the ps keeps its update log, as tensorfleet launch --ps-update-log: a ps "
        "SIGKILL then loses no acknowledged step; off: no log (default: auto, the "
        "launcher's default: a directory of each run in /dev/shm, removed after it)",
    )
    parser.add_argument(
        "--max-gradient-age",
        default=None,
        metavar="N|auto|off",
        help="the example's --max-gradient-age in the disturbed and the undisturbed run "
        "(default: the example's, auto)",
    )
    storm.add_argument(
        "--no-baseline", action="store_true", help="skip the undisturbed run (no accuracy check)"
    )
    parser.add_argument(
        "--results-name",
        metavar="NAME",
        default=None,
        help="write NAME.json and NAME.md (default: chaos / chaos_storm, with _seed<N> for a "
        "seed other than 5), e.g. chaos_term_worker for a run of worker SIGTERMs",
    )
    add_out_dir_option(parser)
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tensorfleet-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"chaos: logs and checkpoints in {workdir}", flush=True)
    if args.storm:
        return storm_main(args, workdir)
    with update_log_env(args) as log_env:
        status, watch, kills, pids, seconds = run(args, workdir, "chaos", args.kills, log_env)
    if len(kills) < args.kills:
        print(
            f"chaos: training ended after {len(kills)} of {args.kills} kills; pass more "
            f"--steps (now {args.steps}) so that every kill lands while it trains",
            flush=True,
        )
    with update_log_env(args) as log_env:
        base_status, base_watch, _, base_pids, base_seconds = run(
            args, workdir, "baseline", 0, log_env
        )
    time.sleep(1.0)  # SIGKILL is delivered asynchronously; give the kernel a moment
    left = [pid for pid in pids + base_pids if alive(pid)]
    count, corrupt = verify_checkpoints(workdir / "chaos" / "checkpoints")

    checks = {
        "exit status 0": status == 0,
        f"{args.kills} kills during training": len(kills) == args.kills,
        "test accuracy line": watch.accuracy is not None,
        f"accuracy within {args.tolerance} of the undisturbed run": (
            watch.accuracy is not None
            and base_watch.accuracy is not None
            and abs(watch.accuracy - base_watch.accuracy) <= args.tolerance
        ),
        "every checkpoint verifies": count > 0 and not corrupt,
        "no process left": not left,
        "every killed task recovered": all(k.recovered_s is not None for k in kills),
    }
    result = {
        "steps": args.steps,
        "seed": args.seed,
        "exit_status": status,
        "seconds": seconds,
        "test_accuracy": watch.accuracy,
        "baseline_exit_status": base_status,
        "baseline_seconds": base_seconds,
        "baseline_test_accuracy": base_watch.accuracy,
        "checkpoints": count,
        "corrupt_checkpoints": corrupt,
        "processes_left": left,
        "kills": [asdict(k) for k in kills],
        "checks": checks,
    }
    table = [
        "| # | task killed | at (s) | global step | back after (s) | first step after | steps lost |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, k in enumerate(kills, 1):
        back = "not recovered" if k.recovered_s is None else f"{k.recovered_s:.1f}"
        table.append(
            f"| {i} | {k.task} | {k.at_s:.0f} | {k.global_step} | {back} | "
            f"{k.first_step_after if k.first_step_after is not None else '-'} | "
            f"{k.steps_lost if k.steps_lost is not None else '-'} |"
        )
    table += [
        "",
        f"disturbed run: exit {status}, test accuracy {watch.accuracy}, {seconds:.0f} s; "
        f"undisturbed run: exit {base_status}, test accuracy {base_watch.accuracy}, "
        f"{base_seconds:.0f} s; {count} checkpoint(s) left, {len(corrupt)} corrupt; "
        f"{len(left)} process(es) left",
        "",
    ]
    table += [f"- [{'x' if ok else ' '}] {name}" for name, ok in checks.items()]
    heading = (
        f"Chaos run: 1 ps + 3 workers, {args.steps} steps, a random task SIGKILLed every "
        f"{args.min_interval:g}-{args.max_interval:g} s (seed {args.seed}), default launcher "
        "settings; measured under whatever else the machine ran"
    )
    write_results(args.results_name or results_name(args.seed), result, heading, table)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
