"""What reliability costs and how fast it recovers, against baselines measured in the same run.

* ``checkpoint``: saving the CNN with its Adam state (19.5 MB) through tensorfleet (the ps
  sends its shard, the chief writes it atomically: temporary directory, fsync, manifest,
  rename) against one process writing the same tensors with ``safetensors.save_file`` and
  an fsync (the baseline: the least any checkpoint of this state can cost on this disk).
* ``ps_recovery``: a 1 ps + 2 worker cluster trains the CNN with checkpoints; the ps is
  killed with SIGKILL and the launcher restarts it. Measured: seconds from the kill to the
  first global step made after the restore, against the seconds a fresh launch of the same
  cluster takes from start to its first global step (the baseline: starting over).
* ``update_log``: the ps's update log (``ps/update_log.py``): seconds per push of the CNN's
  gradients (Adam, one in-process ps, one client) with the log (snapshots as by default, and
  with snapshots off) against the same pushes to a ps without it, in alternating blocks so
  that drifts of the machine hit both alike; the log's bytes left on disk, and the seconds
  a restore takes to come back (snapshot and replay).
* ``training``: what the log costs a training run, the way users meet it: the CNN on a
  local 1 ps + 3 worker cluster (``benchmarks/cnn_training.py``), with the update log and
  without it, alternated ``--rounds`` times; the chief's steady-state steps/s of each.

    .venv/bin/python benchmarks/recovery.py [--repeats 5] [--only update_log|training]

Writes benchmarks/results/recovery.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "src"))

from mnist_cnn import ClassicCNN  # noqa: E402
from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet.environment import PS_UPDATE_LOG_VAR  # noqa: E402
from tensorfleet.launch.local_cluster import LocalCluster  # noqa: E402
from tensorfleet.launch.output import Output  # noqa: E402
from tensorfleet.launch.ports import free_port  # noqa: E402
from tensorfleet.ps.placement import VariableSpec, plan_placement  # noqa: E402
from tensorfleet.ps.service import ParameterService, ServiceConfig  # noqa: E402
from tensorfleet.ps.shard_checkpoint import decode_shard  # noqa: E402
from tensorfleet.ps.update_log_segment import checkpoint_id  # noqa: E402
from tensorfleet.ps.update_rules import Adam  # noqa: E402
from tensorfleet.session.checkpoints import CheckpointDirectory  # noqa: E402
from tensorfleet.wire.service_socket import ServiceSocket  # noqa: E402
from tensorfleet.wire.tensors import dtype_name  # noqa: E402
from tensorfleet.worker.client import ParameterClient  # noqa: E402

SECRET = b"recovery-benchmark-secret-0123456789"
PROGRESS = re.compile(r"Step: (\d+)")


def checkpoint_costs(repeats: int) -> dict[str, list[float]]:
    """Seconds per checkpoint: tensorfleet (ps -> chief -> disk) and the one-process baseline,
    interleaved so that drifts of the machine hit both alike."""
    torch.manual_seed(0)
    model = ClassicCNN()
    named = list(model.named_parameters())
    address = f"127.0.0.1:{free_port()}"
    config = ServiceConfig(0, ("worker:0",))
    service = ParameterService(ServiceSocket(address, SECRET, config.limits), config)
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    thread.start()
    client = ParameterClient([address], SECRET, "worker:0")
    times: dict[str, list[float]] = {"tensorfleet": [], "baseline": []}
    try:
        client.connect()
        specs = [
            VariableSpec(n, tuple(p.shape), dtype_name(p.dtype), p.element_size()) for n, p in named
        ]
        client.register(named, plan_placement(specs, 1), Adam(lr=1e-4), is_chief=True)
        for _, p in named:
            p.grad = torch.randn_like(p)
        client.push_pull()  # Adam's state exists from now on
        optimizer = torch.optim.Adam([p for _, p in named], lr=1e-4)
        optimizer.step()
        baseline_state = {f"value/{n}": p.detach().clone() for n, p in named}
        for i, (n, _) in enumerate(named):
            for key, value in optimizer.state_dict()["state"][i].items():
                baseline_state[f"optim/{n}/{key}"] = value.clone()
        with tempfile.TemporaryDirectory() as tmp:
            directory = CheckpointDirectory(Path(tmp) / "tensorfleet", keep=2)
            placement = {n: {"param": n, "rows": None, "shard": 0} for n, _ in named}
            for repeat in range(repeats):
                started = time.perf_counter()
                step, documents = client.save()
                directory.write(step + repeat, documents, placement)
                times["tensorfleet"].append(time.perf_counter() - started)

                started = time.perf_counter()
                path = Path(tmp) / f"baseline-{repeat}.safetensors"
                save_file(baseline_state, str(path))
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
                times["baseline"].append(time.perf_counter() - started)
                path.unlink()
            times["bytes"] = [float(len(documents[0]))]
    finally:
        client.close()
        stop.set()
        thread.join(10)
        service.socket.close()
    return times


LOG_SIDES = {"without": None, "with": None, "with, no snapshots": 0}
"""The pushes' three sides: no log; the log with the default snapshots (None); never a
snapshot (0: the log grows until the next checkpoint, as before snapshots existed)."""


def update_log_costs(pushes: int, log_root: str | None, blocks: int = 4) -> dict[str, object]:
    """Seconds per push without the update log and with it (snapshots by default, and none),
    in new directories under ``log_root`` (None: the system's temporary directory); the log's
    bytes left; the restore's seconds and updates replayed (with the default snapshots)."""
    torch.manual_seed(0)
    model = ClassicCNN()
    named = list(model.named_parameters())
    specs = [
        VariableSpec(n, tuple(p.shape), dtype_name(p.dtype), p.element_size()) for n, p in named
    ]
    with tempfile.TemporaryDirectory(dir=log_root) as tmp:
        running = []
        clients = {}
        services = {}
        try:
            for index, (name, snapshot_bytes) in enumerate(LOG_SIDES.items()):
                address = f"127.0.0.1:{free_port()}"
                config = ServiceConfig(
                    0,
                    ("worker:0",),
                    update_log_dir=None if name == "without" else str(Path(tmp) / f"log{index}"),
                    update_log_snapshot_bytes=snapshot_bytes,
                )
                service = ParameterService(ServiceSocket(address, SECRET, config.limits), config)
                stop = threading.Event()
                thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
                thread.start()
                running.append((service, stop, thread))
                client = ParameterClient([address], SECRET, "worker:0")
                client.connect()
                client.register(named, plan_placement(specs, 1), Adam(lr=1e-4), is_chief=True)
                clients[name] = client
                services[name] = service
            for _, p in named:
                p.grad = torch.randn_like(p)
            checkpoint = {
                name: client.save() for name, client in clients.items()
            }  # opens a segment
            seconds: dict[str, list[float]] = {name: [] for name in clients}
            for _ in range(blocks):
                for name, client in clients.items():
                    started = time.perf_counter()
                    for _ in range(pushes // blocks):
                        client.push_pull()
                    seconds[name].append((time.perf_counter() - started) / (pushes // blocks))
            log = services["with"].update_log
            log_bytes = sum(f.stat().st_size for _, f in log.segments())
            unbounded_bytes = sum(
                f.stat().st_size for _, f in services["with, no snapshots"].update_log.segments()
            )
            snapshots = log.snapshots
            step, documents = checkpoint["with"]
            state = decode_shard(documents[0])
            chain = log.find(
                checkpoint_id(
                    state.shard, state.global_step, state.version, state.values, state.ema,
                    state.optimizer,
                )
            )  # fmt: skip
            replayed = sum(1 for segment in chain for _ in segment.updates())
            started = time.perf_counter()
            clients["with"].restore(documents, step)  # the snapshot, then the pushes after it
            replay_s = time.perf_counter() - started
        finally:
            for client in clients.values():
                client.close()
            for service, stop, thread in running:
                stop.set()
                thread.join(10)
                service.socket.close()
    logged = pushes // blocks * blocks
    return {
        "push_s": seconds,
        "pushes": logged,
        "snapshots": snapshots,
        "log_bytes_left": log_bytes,
        "log_bytes_left_without_snapshots": unbounded_bytes,
        "restore_s": replay_s,
        "restore_from_snapshot": bool(chain) and chain[0].snapshot is not None,
        "replayed": replayed,
    }


def training_costs(steps: int, rounds: int, log_root: str | None) -> dict[str, list[float]]:
    """The chief's steady-state steps/s on a local 1 ps + 3 worker cluster training the
    CNN, with the update log (in a new directory under ``log_root``) and without it,
    alternated ``rounds`` times."""
    steps_per_s: dict[str, list[float]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory(dir=log_root) as logs, tempfile.TemporaryDirectory() as tmp:
        for round_index in range(rounds):
            for name in steps_per_s:
                run = Path(tmp) / f"{name}-{round_index}"
                metrics = run.with_suffix(".json")
                env = {"PYTHONPATH": os.pathsep.join(sys.path)}
                if name == "with":
                    env[PS_UPDATE_LOG_VAR] = str(Path(logs) / f"log-{round_index}")
                command = [
                    sys.executable, str(ROOT / "benchmarks" / "cnn_training.py"),
                    "--steps", str(steps), "--log-every", "100000", "--logdir", str(run),
                    "--metrics-json", str(metrics), "--test-limit", "500",
                ]  # fmt: skip
                cluster = LocalCluster(1, 3, command, output=_Watch(), max_restarts=0, env=env)
                cluster.start()
                try:
                    status = cluster.wait(timeout=900)
                finally:
                    cluster.stop()
                if status != 0:
                    raise RuntimeError(f"the {name} run of round {round_index} ended {status}")
                figures = json.loads(metrics.read_text())
                steps_per_s[name].append(float(figures["steady_global_steps_per_s"]))
    return steps_per_s


class _Watch(Output):
    """Records when each worker line arrives (the benchmark's clock for progress)."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str, str]] = []
        self.changed = threading.Condition()

    def line(self, task: str, text: str) -> None:
        with self.changed:
            self.lines.append((time.monotonic(), task, text))
            self.changed.notify_all()

    def wait_for(self, predicate, timeout_s: float = 300.0) -> tuple[float, str, str]:
        with self.changed:
            found: list[tuple[float, str, str]] = []

            def check() -> bool:
                found[:] = [entry for entry in self.lines if predicate(entry)]
                return bool(found)

            if not self.changed.wait_for(check, timeout_s):
                tail = "\n".join(f"[{t}] {x}" for _, t, x in self.lines[-40:])
                raise TimeoutError(f"not seen within {timeout_s} s\n{tail}")
            return found[0]


def _cluster(logdir: Path, steps: int, output: _Watch) -> LocalCluster:
    command = [
        sys.executable, str(ROOT / "benchmarks" / "cnn_training.py"),
        "--steps", str(steps), "--log-every", "10", "--logdir", str(logdir),
        "--checkpoint-steps", "100", "--train-limit", "6000", "--test-limit", "500",
    ]  # fmt: skip
    return LocalCluster(
        1,
        2,
        command,
        output=output,
        max_restarts=1,
        env={"PYTHONPATH": os.pathsep.join(sys.path)},
    )


def ps_recovery() -> dict[str, float]:
    """Seconds from a ps SIGKILL to the first step after the restore, and from a fresh
    launch to its first step."""
    with tempfile.TemporaryDirectory() as tmp:
        output = _Watch()
        cluster = _cluster(Path(tmp) / "run", 400, output)
        launched = time.monotonic()
        cluster.start()
        supervisor = threading.Thread(target=cluster.wait, kwargs={"timeout": 600}, daemon=True)
        supervisor.start()
        try:
            first = output.wait_for(lambda e: e[1].startswith("worker") and "Step:" in e[2])
            output.wait_for(lambda e: e[1].startswith("worker") and "Step: 150," in e[2])
            killed = time.monotonic()
            cluster.kill_task("ps:0", signal.SIGKILL)
            restored = output.wait_for(
                lambda e: e[0] > killed and "restored from a checkpoint" in e[2]
            )
            resumed = output.wait_for(lambda e: e[0] > restored[0] and "Step:" in e[2])
            supervisor.join(600)
        finally:
            if supervisor.is_alive():
                cluster.interrupt(signal.SIGTERM)
                supervisor.join(30)
            cluster.stop()
    return {
        "fresh_start_to_first_step_s": first[0] - launched,
        "kill_to_restored_s": restored[0] - killed,
        "kill_to_first_step_after_restore_s": resumed[0] - killed,
        "exit_status": float(cluster.result or 0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--only",
        choices=("update_log", "training"),
        default=None,
        help="measure only this row (update_log: a minute; training and the others launch "
        "clusters: minutes)",
    )
    parser.add_argument(
        "--pushes", type=int, default=200, help="pushes per side of the update_log row"
    )
    parser.add_argument(
        "--log-root",
        default=None,
        metavar="DIR",
        help="where the update log goes in the update_log and training rows (default: the "
        "system's temporary directory; /dev/shm: memory, no disk writeback)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs per side of the training row, alternated"
    )
    parser.add_argument(
        "--steps", type=int, default=1500, help="global steps of each run of the training row"
    )
    add_out_dir_option(parser)
    args = parser.parse_args()
    where = args.log_root or tempfile.gettempdir()
    if args.only == "training":
        trained = training_costs(args.steps, args.rounds, args.log_root)
        with_log = statistics.median(trained["with"])
        without = statistics.median(trained["without"])
        write_results(
            "recovery_training",
            {"steady_global_steps_per_s": trained, "steps": args.steps, "log_root": where},
            f"What the ps update log costs a training run, {time.strftime('%Y-%m-%d %H:%M')}: "
            f"the CNN (Adam) on 1 ps + 3 workers, {args.steps} global steps, "
            f"{args.rounds} runs each, alternated; the chief's steady-state global steps/s",
            [
                "| what | with the update log | without it, same run | ratio |",
                "|---|---|---|---|",
                f"| training, update log in {where} "
                f"({', '.join(f'{x:.1f}' for x in trained['with'])} vs "
                f"{', '.join(f'{x:.1f}' for x in trained['without'])}) "
                f"| {with_log:.1f} steps/s | {without:.1f} steps/s | {with_log / without:.2f}x |",
            ],
        )
        return 0
    logged = update_log_costs(args.pushes, args.log_root)
    pushes = {name: statistics.median(s) for name, s in logged["push_s"].items()}
    without = pushes["without"]
    log_row = (
        f"| push of the CNN's gradients (Adam) to a ps with the update log vs without it "
        f"({logged['pushes']} pushes each, log in {where}; {logged['snapshots']} snapshots "
        f"written, {logged['log_bytes_left'] / 1e6:.0f} MB left against "
        f"{logged['log_bytes_left_without_snapshots'] / 1e6:.0f} MB without snapshots, "
        f"{pushes['with, no snapshots'] * 1000:.1f} ms a push; a restore took "
        f"{logged['restore_s']:.2f} s, replaying {logged['replayed']} updates"
        f"{' after a snapshot' if logged['restore_from_snapshot'] else ''}) "
        f"| {pushes['with'] * 1000:.1f} ms | {without * 1000:.1f} ms "
        f"| {pushes['with'] / without:.2f}x |"
    )
    if args.only == "update_log":
        write_results(
            "recovery_update_log",
            {"update_log": logged},
            f"The ps update log's cost per push, {time.strftime('%Y-%m-%d %H:%M')}",
            [
                "| what | tensorfleet | baseline in the same run | ratio |",
                "|---|---|---|---|",
                log_row,
            ],
        )
        return 0
    costs = checkpoint_costs(args.repeats)
    recovery = ps_recovery()
    ours, base = statistics.median(costs["tensorfleet"]), statistics.median(costs["baseline"])
    heading = (
        f"Reliability costs, {time.strftime('%Y-%m-%d %H:%M')}: checkpoint of the CNN with Adam "
        f"state ({costs['bytes'][0] / 1e6:.1f} MB, median of {args.repeats}); ps killed and "
        "restarted during training (1 ps + 2 workers)"
    )
    table = [
        "| what | tensorfleet | baseline in the same run | ratio |",
        "|---|---|---|---|",
        f"| checkpoint (ps -> chief -> disk, atomic) vs safetensors.save_file + fsync in one "
        f"process | {ours * 1000:.0f} ms | {base * 1000:.0f} ms | {ours / base:.2f}x |",
        f"| ps SIGKILL -> first step after the restore vs a fresh launch -> its first step | "
        f"{recovery['kill_to_first_step_after_restore_s']:.1f} s (restored after "
        f"{recovery['kill_to_restored_s']:.1f} s) | {recovery['fresh_start_to_first_step_s']:.1f} s | "
        f"{recovery['kill_to_first_step_after_restore_s'] / recovery['fresh_start_to_first_step_s']:.2f}x |",
        log_row,
    ]
    write_results(
        "recovery",
        {
            "checkpoint_s": costs,
            "ps_recovery": recovery,
            "update_log": logged,
            "repeats": args.repeats,
        },
        heading,
        table,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
