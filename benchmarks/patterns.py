"""Benchmarks of the cluster patterns, each against a baseline measured in the same run.

* sweep throughput: the same trials (fixed work each) with ``--slots`` slots vs one slot
  (one after another), in trials per minute;
* actor/learner: CartPole samples per second with ``--actors`` actor processes and one
  learner vs one process that plays and learns in turn (the same PPO, the same steps).

    .venv/bin/python benchmarks/patterns.py --trials 8 --slots 2 --steps 400 --al-steps 30000
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet.patterns.broadcast import free_address  # noqa: E402
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400, help="training steps per trial")
    parser.add_argument("--al-steps", type=int, default=30_000, help="CartPole environment steps")
    parser.add_argument("--actors", type=int, default=2)
    add_out_dir_option(parser)
    args = parser.parse_args()
    serial, serial_done = sweep_minutes(args.trials, 1, args.steps)
    parallel, parallel_done = sweep_minutes(args.trials, args.slots, args.steps)
    single, distributed = actor_learner(args.al_steps, args.actors)
    result = {
        "sweep": {
            "trials": args.trials,
            "steps_per_trial": args.steps,
            "serial_trials_per_min": serial_done / serial,
            "parallel_slots": args.slots,
            "parallel_trials_per_min": parallel_done / parallel,
            "ratio": (parallel_done / parallel) / (serial_done / serial),
        },
        "actor_learner": {
            "env_steps": args.al_steps,
            "actors": args.actors,
            "single_samples_per_s": single["samples_per_s"],
            "distributed_samples_per_s": distributed["samples_per_s"],
            "ratio": distributed["samples_per_s"] / single["samples_per_s"],
            "dropped_stale": distributed["dropped_stale"],
        },
        "cpus": os.cpu_count(),
    }
    s, a = result["sweep"], result["actor_learner"]
    table = [
        "| what | baseline | tensorfleet | ratio |",
        "|---|---|---|---|",
        f"| sweep, {s['trials']} trials of {s['steps_per_trial']} steps (trials/min) | 1 slot: {s['serial_trials_per_min']:.1f} | {s['parallel_slots']} slots: {s['parallel_trials_per_min']:.1f} | {s['ratio']:.2f}x |",
        f"| actor/learner CartPole, {a['env_steps']} steps (samples/s) | one process: {a['single_samples_per_s']:.0f} | {a['actors']} actors + learner: {a['distributed_samples_per_s']:.0f} | {a['ratio']:.2f}x |",
    ]
    write_results("patterns", result, f"Cluster patterns ({os.cpu_count()} CPUs)", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
