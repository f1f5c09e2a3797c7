"""Benchmarks of the cluster patterns, each against a baseline measured in the same run.

* sweep throughput: the same trials (fixed work each) with ``--slots`` slots vs one slot
  (one after another), in trials per minute;
* a search of short trials (``--search-trials`` TPE trials of ``--search-steps`` steps, about
  1 s each) five ways in one run: an Optuna loop by hand in this process (the baseline, its
  imports done before its clock), ``tensorfleet sweep`` (:func:`run_sweep`, the function the
  command calls) with 1 slot and with 2 slots, each starting its executor (as a command
  does), and the same two after ``preload()`` (the executor forked from the program's
  preloaded interpreter, whose imports were done before the clock, as the hand loop's);
  trials/min and their ratios to the hand loop, and each sweep's wall time against the
  ideal (trials x the hand loop's mean trial time / slots); and what 2 slots can get on the
  machine: two copies of the hand loop side by side, in processes of their own;
* the same search as commands (``--only commands``), each from its start to its exit as a
  user at a shell sees it: a hand-written Optuna script (``python -c``, paying its imports)
  against ``tensorfleet sweep config.json`` with 1 and with 2 slots;
* actor/learner: CartPole samples per second with ``--actors`` actor processes and one
  learner vs one process that plays and learns in turn (the same PPO, the same steps);
* broadcast: seconds from ``WeightPublisher.publish()`` of a ``--broadcast-mb`` model until
  the last of ``--subscribers`` subscriber processes on this host holds it (each waiting in
  ``WeightSubscriber.wait_for``), through the same-host path (payloads in shared memory)
  against the same over TCP (``TENSORFLEET_SHARED_MEMORY=0`` in the subscribers), in one run.

    .venv/bin/python benchmarks/patterns.py --trials 8 --slots 2 --steps 400 --al-steps 30000
    .venv/bin/python benchmarks/patterns.py --only search --search-trials 20 --search-steps 1800 \
        --search-repeats 2
    .venv/bin/python benchmarks/patterns.py --only commands --search-trials 20 --search-steps 1800 \
        --search-repeats 3
    .venv/bin/python benchmarks/patterns.py --only broadcast --broadcast-mb 100 --subscribers 8
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import resource
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet.patterns.broadcast import WeightPublisher, free_address  # noqa: E402
from tensorfleet.patterns.preloaded_interpreter import preload, release_preloaded  # noqa: E402
from tensorfleet.patterns.sweep import run_sweep  # noqa: E402
from tensorfleet.patterns.sweep_config import SweepConfig  # noqa: E402
from tensorfleet.patterns.sweep_report import PlainProgress  # noqa: E402


def sweep_minutes(trials: int, slots: int, steps: int) -> tuple[float, int]:
    config = SweepConfig(
        entry="fixed_trial:train",
        space={},
        configurations=[{"seed": i, "lr": 0.05, "steps": steps} for i in range(trials)],
        search="list",
        metric="loss",
        slots=slots,
        pythonpath=[str(ROOT / "benchmarks" / "programs")],
    )
    with tempfile.TemporaryDirectory() as directory:
        started = time.monotonic()
        result = run_sweep(
            config, Path(directory) / "sweep", progress=PlainProgress("loss", io.StringIO())
        )
        minutes = (time.monotonic() - started) / 60
    complete = sum(r.state == "complete" for r in result.records)
    return minutes, complete


def search_space(steps: int) -> dict:
    """The searched space; ``steps`` is a one-value choice so that every trial does the same
    work whatever the sampler picks."""
    return {
        "lr": {"type": "loguniform", "low": 1e-3, "high": 0.3},
        "width": [32, 64],
        "steps": [steps],
    }


def hand_loop(trials: int, steps: int, seed: int) -> dict:
    """The baseline: the same trial function called by a hand-written Optuna loop (TPE, an
    in-memory study) in this process."""
    import optuna

    from tensorfleet.patterns.trial import Trial

    sys.path.insert(0, str(ROOT / "benchmarks" / "programs"))
    # What torch's optimizers import at their first step (1.7 s, once per process): imported
    # before the clock starts, so the baseline's trials are all steady-state ones.
    import torch._dynamo  # noqa: F401
    from fixed_trial import search_train

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
    durations: list[float] = []
    durations_cpu: list[float] = []
    with tempfile.TemporaryDirectory() as directory:

        def objective(ot: optuna.Trial) -> float:
            params = {
                "lr": ot.suggest_float("lr", 1e-3, 0.3, log=True),
                "width": ot.suggest_categorical("width", [32, 64]),
                "steps": ot.suggest_categorical("steps", [steps]),
            }
            trial_dir = Path(directory) / str(ot.number)
            trial_dir.mkdir()
            started, cpu = time.monotonic(), time.process_time()
            value = search_train(Trial(trial_dir, ot.number, params))
            durations.append(time.monotonic() - started)
            durations_cpu.append(time.process_time() - cpu)
            return value

        started, cpu = time.monotonic(), time.process_time()
        study.optimize(objective, n_trials=trials)
        wall = time.monotonic() - started
        cpu = time.process_time() - cpu
    return {
        "trials": trials,
        "wall_s": wall,
        "trials_per_min": trials / wall * 60,
        "mean_trial_s": statistics.fmean(durations),
        # CPU seconds per trial outside the trial function: the loop's own overhead, a figure
        # the machine's load changes far less than wall time
        "overhead_cpu_per_trial_s": (cpu - sum(durations_cpu)) / trials,
    }


_SIDE_BY_SIDE_CHILD = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {benchmarks!r})
import patterns, optuna, torch._dynamo  # noqa: E401 (the imports, before the clock)
sys.path.insert(0, {programs!r})
import fixed_trial  # noqa: F401
print("ready", flush=True)
go = Path({go!r})
deadline = time.monotonic() + 300
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.005)
print(json.dumps(patterns.hand_loop({trials}, {steps}, {seed})), flush=True)
"""


def hand_loops_side_by_side(trials: int, steps: int, seed: int, processes: int = 2) -> dict:
    """What the machine gives two slots: ``processes`` copies of the hand loop, each in a
    process of its own with its imports done, started at the same moment; their trials
    together per minute of the slowest one's wall time. The sweep with 2 slots cannot beat
    it (it runs the same trials side by side, plus its own work)."""
    with tempfile.TemporaryDirectory() as directory:
        go = Path(directory) / "go"
        code = _SIDE_BY_SIDE_CHILD.format(
            benchmarks=str(ROOT / "benchmarks"),
            programs=str(ROOT / "benchmarks" / "programs"),
            go=str(go),
            trials=trials,
            steps=steps,
            seed=seed,
        )
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        children = [
            subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
            )
            for _ in range(processes)
        ]
        try:
            for child in children:
                assert child.stdout is not None
                line = child.stdout.readline()
                if line.strip() != "ready":
                    raise RuntimeError(f"a side-by-side hand loop did not start: {line!r}")
            started = time.monotonic()
            go.touch()
            results = []
            for child in children:  # each prints its result when its last trial ended
                assert child.stdout is not None
                results.append(json.loads(child.stdout.readline()))
            wall = time.monotonic() - started
            for child in children:  # their exits (torch's teardown) are not on the clock
                child.wait(timeout=600)
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
    return {
        "processes": processes,
        "wall_s": wall,
        "trials_per_min": processes * trials / wall * 60,
        "mean_trial_s": statistics.fmean(r["mean_trial_s"] for r in results),
    }


def sweep_search(trials: int, steps: int, seed: int, slots: int) -> dict:
    """The same search through ``tensorfleet sweep`` (its function, in this process)."""
    config = SweepConfig(
        entry="fixed_trial:search_train",
        space=search_space(steps),
        search="optuna",
        sampler="tpe",
        trials=trials,
        seed=seed,
        metric="loss",
        slots=slots,
        pythonpath=[str(ROOT / "benchmarks" / "programs")],
    )
    with tempfile.TemporaryDirectory() as directory:
        started = time.monotonic()
        own, children = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        result = run_sweep(
            config, Path(directory) / "sweep", progress=PlainProgress("loss", io.StringIO())
        )
        ended = time.monotonic()
        own_cpu = _cpu(resource.getrusage(resource.RUSAGE_SELF)) - _cpu(own)
        # the executors (reaped when the sweep ends) with the trials they reaped
        children_cpu = _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - _cpu(children)
    records = result.records
    complete = sum(r.state == "complete" for r in records)
    first = min(r.started for r in records)
    last = max(r.started + (r.seconds or 0.0) for r in records)
    wall = ended - started
    return {
        "slots": slots,
        "complete": complete,
        "wall_s": wall,
        "trials_per_min": complete / wall * 60,
        "median_trial_s": statistics.median(r.seconds for r in records if r.seconds),
        "until_first_trial_s": first - started,
        # from the first trial's start to the last one's end: the per-trial overhead alone,
        # without the executors' start and the results at the end
        "between_trials_per_min": complete / (last - first) * 60,
        "after_last_trial_s": ended - last,
        # CPU seconds of the sweep's own process per trial (study, files, waiting), and of
        # its executors and trials together (each executor's import once, the trials' work)
        "sweep_cpu_per_trial_s": own_cpu / len(records),
        "children_cpu_s": children_cpu,
    }


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def fresh_import_s() -> float:
    """What a hand-written loop started as a script pays before its first trial, and each
    sweep executor once: a fresh interpreter importing torch (with what its optimizers import
    at their first step), optuna and tensorfleet."""
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", "import torch, torch._dynamo, optuna, tensorfleet"],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
        check=True,
        timeout=300,
    )
    return time.monotonic() - started


_HAND_SCRIPT = """
import sys, time
import optuna, torch
sys.path.insert(0, {programs!r})
from fixed_trial import search_train
from tensorfleet.patterns.trial import Trial
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed={seed}))
def objective(ot):
    params = {{
        "lr": ot.suggest_float("lr", 1e-3, 0.3, log=True),
        "width": ot.suggest_categorical("width", [32, 64]),
        "steps": ot.suggest_categorical("steps", [{steps}]),
    }}
    directory = {directory!r} + "/" + str(ot.number)
    import os; os.makedirs(directory)
    from pathlib import Path
    return search_train(Trial(Path(directory), ot.number, params))
study.optimize(objective, n_trials={trials})
"""


def commands_row(trials: int, steps: int, seed: int, repeats: int) -> dict:
    """The same search as commands, each from its start to its exit, as a user at a shell
    sees them: a hand-written Optuna script (``python search.py``, paying its own imports of
    torch and optuna) against ``tensorfleet sweep config.json`` with 1 and with 2 slots
    (whose executor imports torch once). Rounds alternate the order; medians."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    walls: dict[str, list[float]] = {"hand_script": [], "sweep_one_slot": [], "sweep_two_slots": []}

    def hand(directory: Path) -> list[str]:
        code = _HAND_SCRIPT.format(
            programs=str(ROOT / "benchmarks" / "programs"),
            seed=seed,
            steps=steps,
            trials=trials,
            directory=str(directory),
        )
        return [sys.executable, "-c", code]

    def sweep(directory: Path, slots: int) -> list[str]:
        config = {
            "entry": "fixed_trial:search_train",
            "space": search_space(steps),
            "search": "optuna",
            "sampler": "tpe",
            "trials": trials,
            "seed": seed,
            "metric": "loss",
            "slots": slots,
            "pythonpath": [str(ROOT / "benchmarks" / "programs")],
        }
        (directory / "config.json").write_text(json.dumps(config))
        return [
            sys.executable, "-m", "tensorfleet", "sweep", str(directory / "config.json"),
            "--dir", str(directory / "sweep"), "--no-live",
        ]  # fmt: skip

    ways = {
        "hand_script": hand,
        "sweep_one_slot": lambda d: sweep(d, 1),
        "sweep_two_slots": lambda d: sweep(d, 2),
    }
    for round_ in range(repeats):
        for name in list(ways) if round_ % 2 == 0 else list(ways)[::-1]:
            with tempfile.TemporaryDirectory() as directory:
                argv = ways[name](Path(directory))
                started = time.monotonic()
                done = subprocess.run(
                    argv, env=env, capture_output=True, text=True, timeout=900, check=False
                )
                walls[name].append(time.monotonic() - started)
                if done.returncode != 0:
                    raise RuntimeError(f"{name} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    medians = {name: statistics.median(values) for name, values in walls.items()}
    return {
        "repeats": repeats,
        "wall_s": medians,
        "walls": walls,
        "trials_per_min": {name: trials / wall * 60 for name, wall in medians.items()},
        "ratio_to_hand_script": {
            name: medians["hand_script"] / wall for name, wall in medians.items()
        },
    }


def search_row(trials: int, steps: int, repeats: int = 1, seed: int = 0) -> dict:
    """The three ways, ``repeats`` rounds (every other round in reverse order, so that a
    change of the machine's load does not favour one way); the median of each figure over
    the rounds, and the ratios of the medians."""
    ways = {
        "hand_loop": lambda: hand_loop(trials, steps, seed),
        "one_slot": lambda: sweep_search(trials, steps, seed, 1),
        "two_slots": lambda: sweep_search(trials, steps, seed, 2),
        "one_slot_preloaded": lambda: sweep_search(trials, steps, seed, 1),
        "two_slots_preloaded": lambda: sweep_search(trials, steps, seed, 2),
        "two_hand_loops": lambda: hand_loops_side_by_side(trials, steps, seed, 2),
    }
    runs: dict[str, list[dict]] = {name: [] for name in ways}
    imports = [fresh_import_s()]
    for round_ in range(repeats):
        for name in list(ways) if round_ % 2 == 0 else list(ways)[::-1]:
            if name.endswith("_preloaded"):
                # started, and its imports done, before the clock: as the hand loop's
                preload(wait=True)
            else:
                release_preloaded()  # each sweep starts its executor, as a command does
            runs[name].append(ways[name]())
        release_preloaded()
        imports.append(fresh_import_s())
    medians = {
        name: {key: statistics.median(run[key] for run in done) for key in done[0]}
        for name, done in runs.items()
    }
    hand = medians["hand_loop"]
    for name in ("one_slot", "two_slots", "one_slot_preloaded", "two_slots_preloaded"):
        run = medians[name]
        run["ratio_to_hand_loop"] = run["trials_per_min"] / hand["trials_per_min"]
        run["between_ratio_to_hand_loop"] = run["between_trials_per_min"] / hand["trials_per_min"]
        run["ideal_wall_s"] = trials * hand["mean_trial_s"] / run["slots"]
        run["wall_to_ideal"] = run["wall_s"] / run["ideal_wall_s"]
    two = medians["two_hand_loops"]
    two["ratio_to_hand_loop"] = two["trials_per_min"] / hand["trials_per_min"]
    return {
        "trials": trials,
        "steps": steps,
        "repeats": repeats,
        "fresh_import_s": statistics.median(imports),
        **medians,
        "runs": runs,
    }


def actor_learner(al_steps: int, actors: int) -> tuple[dict, dict]:
    spec = importlib.util.spec_from_file_location(
        "cartpole_actor_learner", ROOT / "examples" / "cartpole_actor_learner.py"
    )
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    # No early stop: both run exactly the step budget.
    settings = example.Settings(max_steps=al_steps, target=math.inf, eval_episodes=1)
    single = example.run_single(settings, log=lambda line: None)
    secret = secrets.token_hex(32)
    address = free_address()
    env = dict(os.environ, TENSORFLEET_SECRET=secret)
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "examples" / "cartpole_actor_learner.py"),
                "--role",
                "actor",
                "--learner",
                address,
                "--name",
                f"actor:{i}",
                "--seed",
                str(i + 1),
            ],
            env=env,
        )
        for i in range(actors)
    ]
    try:
        distributed = example.run_learner(address, secret.encode(), settings, log=lambda line: None)
    finally:
        for p in processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return single, distributed


#: A subscriber process of the broadcast row: connects, says READY, takes versions 1 and 2
#: (the first answer of a kind teaches the client its size, so that the next goes through
#: shared memory on this host; the second fills the reply region the later ones reuse), then
#: waits for version 3 and prints the wall-clock time it held it (and its checksum, checked
#: by the parent): what every publish of a training but its first two costs.
SUBSCRIBER = """
import sys, time
from tensorfleet.patterns.broadcast import WeightSubscriber
with WeightSubscriber(sys.argv[1], sys.argv[2].encode(), timeout_s=120) as subscriber:
    print("READY", flush=True)
    subscriber.wait_for(1, timeout_s=120)
    print("FIRST", flush=True)
    subscriber.wait_for(2, timeout_s=120)
    print("SECOND", flush=True)
    snapshot = subscriber.wait_for(3, timeout_s=120)
    held = time.time()
    print("HELD", held, float(snapshot.tensors["weight"][::4096].double().sum()), flush=True)
"""


def broadcast_seconds(megabytes: int, subscribers: int, shared_memory: bool) -> dict:
    """Seconds from a publish() (the third: every publish of a training but its first two)
    until the last subscriber process holds the snapshot."""
    import torch

    secret = secrets.token_hex(32)
    address = free_address()
    first = torch.randn(megabytes * (1 << 20) // 4)
    second, weight = first + 1.0, first + 2.0
    expected = float(weight[::4096].double().sum())
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT / "src"),
        TENSORFLEET_SHARED_MEMORY="1" if shared_memory else "0",
    )
    with WeightPublisher(address, secret.encode()) as publisher:
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", SUBSCRIBER, address, secret],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(subscribers)
        ]
        try:
            for word, action in (("READY", lambda: publisher.publish({"weight": first})),
                                 ("FIRST", lambda: publisher.publish({"weight": second})),
                                 ("SECOND", lambda: None)):  # fmt: skip
                for process in processes:
                    line = process.stdout.readline()
                    if not line.startswith(word):
                        raise RuntimeError(f"a subscriber failed: {line}{process.stdout.read()}")
                action()
            held_by = time.monotonic() + 30.0  # every subscriber's long poll is held
            while publisher.waiting < subscribers:
                if time.monotonic() > held_by:
                    raise RuntimeError(
                        f"only {publisher.waiting} of {subscribers} subscribers waited for the "
                        "next version within 30 s"
                    )
                time.sleep(0.01)
            started = time.time()
            publisher.publish({"weight": weight})
            held = []
            for process in processes:
                output = process.communicate(timeout=300)[0]
                line = next((x for x in output.splitlines() if x.startswith("HELD")), None)
                if process.returncode != 0 or line is None:
                    raise RuntimeError(f"a subscriber failed:\n{output}")
                _, when, checksum = line.split()
                if abs(float(checksum) - expected) > 1e-6 * max(1.0, abs(expected)):
                    raise RuntimeError(f"a subscriber got other weights: {checksum} != {expected}")
                held.append(float(when) - started)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    return {"last_s": max(held), "first_s": min(held), "median_s": statistics.median(held)}


def broadcast_row(args: argparse.Namespace, result: dict) -> str:
    tcp = broadcast_seconds(args.broadcast_mb, args.subscribers, shared_memory=False)
    same_host = broadcast_seconds(args.broadcast_mb, args.subscribers, shared_memory=True)
    b = result["broadcast"] = {
        "megabytes": args.broadcast_mb,
        "subscribers": args.subscribers,
        "tcp": tcp,
        "shared_memory": same_host,
        "ratio": tcp["last_s"] / same_host["last_s"],
    }
    return (
        f"| broadcast of {b['megabytes']} MB to {b['subscribers']} subscriber processes on this "
        f"host (s from publish() to the last one holding it; goal <= 2 s) | over TCP: "
        f"{tcp['last_s']:.2f} s (first {tcp['first_s']:.2f} s) | same-host path: "
        f"{same_host['last_s']:.2f} s (first {same_host['first_s']:.2f} s) | "
        f"{b['ratio']:.2f}x faster |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400, help="training steps per trial")
    parser.add_argument("--al-steps", type=int, default=30_000, help="CartPole environment steps")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--broadcast-mb", type=int, default=100, help="broadcast model size")
    parser.add_argument("--subscribers", type=int, default=8, help="broadcast subscribers")
    parser.add_argument(
        "--search-trials", type=int, default=20, help="trials of the search row (default 20)"
    )
    parser.add_argument(
        "--search-steps",
        type=int,
        default=1800,
        help="training steps per search trial (1800: about 1 s on this 2-core machine at load "
        "1-2; 300 took 0.17 s there and 1.07 s at load 13)",
    )
    parser.add_argument(
        "--search-repeats",
        type=int,
        default=1,
        help="rounds of the search row's three ways (medians are reported; default 1)",
    )
    parser.add_argument(
        "--only",
        choices=("sweep", "search", "commands", "actor_learner", "broadcast"),
        action="append",
        help="run only these rows (repeatable; default: all)",
    )
    add_out_dir_option(parser)
    args = parser.parse_args()
    rows = set(args.only or ("sweep", "search", "commands", "actor_learner", "broadcast"))
    result: dict = {"cpus": os.cpu_count(), "load_avg_1min_at_start": os.getloadavg()[0]}
    table = ["| what | baseline | tensorfleet | ratio |", "|---|---|---|---|"]
    if "sweep" in rows:
        table.append(sweep_table_row(args, result))
    if "commands" in rows:
        commands = result["commands"] = commands_row(
            args.search_trials, args.search_steps, 0, args.search_repeats
        )
        for name, label in (("sweep_one_slot", "1 slot"), ("sweep_two_slots", "2 slots")):
            table.append(
                f"| search as commands, {args.search_trials} TPE trials of "
                f"{args.search_steps} steps, median of {commands['repeats']} (start to exit, "
                f"imports included on both sides) | hand-written Optuna script: "
                f"{commands['wall_s']['hand_script']:.1f} s | `tensorfleet sweep`, {label}: "
                f"{commands['wall_s'][name]:.1f} s | {commands['ratio_to_hand_script'][name]:.2f}x |"
            )
    if "search" in rows:
        search = result["search"] = search_row(
            args.search_trials, args.search_steps, args.search_repeats
        )
        hand = search["hand_loop"]
        for key, name in (
            ("one_slot", "1 slot"),
            ("two_slots", "2 slots"),
            ("one_slot_preloaded", "1 slot, after preload()"),
            ("two_slots_preloaded", "2 slots, after preload()"),
        ):
            run = search[key]
            table.append(
                f"| search, {search['trials']} TPE trials of {hand['mean_trial_s']:.2f} s, "
                f"median of {search['repeats']} "
                f"(trials/min; wall vs ideal) | Optuna loop by hand: {hand['trials_per_min']:.1f} "
                f"| tensorfleet sweep, {name}: {run['trials_per_min']:.1f}; wall "
                f"{run['wall_s']:.1f} s = {run['wall_to_ideal']:.2f}x ideal "
                f"({run['ideal_wall_s']:.1f} s; first trial after {run['until_first_trial_s']:.1f} s; "
                f"first trial's start to last one's end: {run['between_trials_per_min']:.1f}, "
                f"{run['between_ratio_to_hand_loop']:.2f}x; CPU per trial outside the trials: "
                f"sweep process {run['sweep_cpu_per_trial_s'] * 1000:.0f} ms, hand loop "
                f"{hand['overhead_cpu_per_trial_s'] * 1000:.0f} ms) | "
                f"{run['ratio_to_hand_loop']:.2f}x |"
            )
        two = search["two_hand_loops"]
        table.append(
            f"| what 2 slots can get on this machine: two hand loops side by side, each in its "
            f"own process (trials/min together; a trial took {two['mean_trial_s']:.2f} s) | "
            f"Optuna loop by hand: {hand['trials_per_min']:.1f} | two of them: "
            f"{two['trials_per_min']:.1f} | {two['ratio_to_hand_loop']:.2f}x |"
        )
        table.append(
            f"\n(a fresh interpreter importing torch, torch._dynamo, optuna and tensorfleet took "
            f"{search['fresh_import_s']:.1f} s in this run: what a hand-written loop started as a "
            "script pays once, and each sweep executor once; the hand loop above ran in a warm "
            "process, its imports done before its clock started; the sweeps 'after preload()' "
            "forked their executors from the preloaded interpreter, started and ready before "
            "their clock)"
        )
    if "actor_learner" in rows:
        table.append(actor_learner_row(args, result))
    if "broadcast" in rows:
        table.append(broadcast_row(args, result))
    # a partial run (--only) keeps its own files, next to the full run's patterns.json
    name = "patterns" if args.only is None else "_".join(["patterns", *sorted(rows)])
    write_results(name, result, f"Cluster patterns ({os.cpu_count()} CPUs)", table)
    return 0


def sweep_table_row(args: argparse.Namespace, result: dict) -> str:
    serial, serial_done = sweep_minutes(args.trials, 1, args.steps)
    parallel, parallel_done = sweep_minutes(args.trials, args.slots, args.steps)
    s = result["sweep"] = {
        "trials": args.trials,
        "steps_per_trial": args.steps,
        "serial_trials_per_min": serial_done / serial,
        "parallel_slots": args.slots,
        "parallel_trials_per_min": parallel_done / parallel,
        "ratio": (parallel_done / parallel) / (serial_done / serial),
    }
    return (
        f"| sweep, {s['trials']} trials of {s['steps_per_trial']} steps (trials/min) | 1 slot: "
        f"{s['serial_trials_per_min']:.1f} | {s['parallel_slots']} slots: "
        f"{s['parallel_trials_per_min']:.1f} | {s['ratio']:.2f}x |"
    )


def actor_learner_row(args: argparse.Namespace, result: dict) -> str:
    single, distributed = actor_learner(args.al_steps, args.actors)
    a = result["actor_learner"] = {
        "env_steps": args.al_steps,
        "actors": args.actors,
        "single_samples_per_s": single["samples_per_s"],
        "distributed_samples_per_s": distributed["samples_per_s"],
        "ratio": distributed["samples_per_s"] / single["samples_per_s"],
        "dropped_stale": distributed["dropped_stale"],
    }
    return (
        f"| actor/learner CartPole, {a['env_steps']} steps (samples/s) | one process: "
        f"{a['single_samples_per_s']:.0f} | {a['actors']} actors + learner: "
        f"{a['distributed_samples_per_s']:.0f} | {a['ratio']:.2f}x |"
    )


if __name__ == "__main__":
    raise SystemExit(main())
