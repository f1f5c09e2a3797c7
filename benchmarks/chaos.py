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
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet.errors import CheckpointError, LaunchError  # noqa: E402
from tensorfleet.launch.local_cluster import LocalCluster  # noqa: E402
from tensorfleet.launch.output import PlainOutput  # noqa: E402
from tensorfleet.session.checkpoints import CheckpointDirectory, read_checkpoint  # noqa: E402

EXAMPLE = ROOT / "examples" / "mnist_cnn.py"
STEP_LINE = re.compile(r"^Worker: (\d+), Step: (\d+)")
ACCURACY_LINE = re.compile(r"^Test accuracy: (\d\.\d+)")
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

    def __post_init__(self) -> None:
        self._file = self.log_path.open("w")
        super().__init__(self._file, self._file)
        self._watch_lock = threading.Lock()

    def line(self, task: str, text: str) -> None:
        super().line(task, text)
        if self.echo:
            print(f"[{task}] {text}", flush=True)
        if match := STEP_LINE.match(text):
            with self._watch_lock:
                self.steps.append((time.monotonic(), int(match.group(1)), int(match.group(2))))
        if task == "worker:0" and (match := ACCURACY_LINE.match(text)):
            self.accuracy = float(match.group(1))

    def message(self, text: str, level: str = "info") -> None:
        super().message(text, level)
        print(f"[launcher] {text.splitlines()[0]}", flush=True)
        if match := re.match(r"restarted (\S+) ", text):
            with self._watch_lock:
                self.restarted.setdefault(match.group(1), []).append(time.monotonic())

    def current_step(self) -> int:
        """The global step now: the highest seen since the latest ps restart (the global
        step goes back only when a restarted ps is restored from a checkpoint)."""
        with self._watch_lock:
            since = max(self.restarted.get("ps:0", [0.0]))
            after = [step for t, _, step in self.steps if t > since]
            return max(after or [step for _, _, step in self.steps] or [0])

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
    ]  # fmt: skip


def run(
    args: argparse.Namespace, workdir: Path, name: str, kills: int
) -> tuple[int, Watch, list[Kill], list[int], float]:
    """Run the cluster, killing ``kills`` random tasks; (status, watch, kills, pids, seconds)."""
    logdir = workdir / name
    watch = Watch(workdir / f"{name}.log", echo=args.echo)
    cluster = LocalCluster(1, 3, example_command(args, logdir), output=watch)
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
    add_out_dir_option(parser)
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tensorfleet-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"chaos: logs and checkpoints in {workdir}", flush=True)
    status, watch, kills, pids, seconds = run(args, workdir, "chaos", args.kills)
    if len(kills) < args.kills:
        print(
            f"chaos: training ended after {len(kills)} of {args.kills} kills; pass more "
            f"--steps (now {args.steps}) so that every kill lands while it trains",
            flush=True,
        )
    base_status, base_watch, _, base_pids, base_seconds = run(args, workdir, "baseline", 0)
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
    write_results(results_name(args.seed), result, heading, table)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
