"""Benchmarks of population-based training (:mod:`tensorfleet.patterns.pbt`), each against a
baseline measured in the same run:

* the exploit copy: ``copy_model`` of a member of ``--copy-params`` float32 parameters with
  Adam's state (two moments: three times the parameters' bytes) onto another member on one
  ps task, the round trip the PBT driver pays, against a ``pull`` of the same member's values
  (one third of the bytes) over the same connection; also the ps's own time for the copy
  (:func:`~tensorfleet.ps.namespace_copy.copy_model` called directly);
* PBT against fixed hyperparameters at the same budget: examples/pbt_schedule.py's noisy
  regression, 4 members of ``--rounds`` x ``--steps-per-round`` SGD steps each, with
  exploit/explore vs the same 4 members keeping their initial learning rates (4 runs of the
  same steps: the same total budget); the best member's final score (lower is better) for
  each of ``--seeds`` seeds, and the ratio best-fixed / PBT; seed 0's PBT lineage is drawn in
  ``pbt_lineage.png`` beside the results.

    .venv/bin/python benchmarks/pbt.py
    .venv/bin/python benchmarks/pbt.py --copy-params 100000 --copy-repeats 3 --seeds 1 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from results_writer import add_out_dir_option, results_dir, write_results  # noqa: E402

from tensorfleet.optim import Adam  # noqa: E402
from tensorfleet.patterns.pbt import run_pbt  # noqa: E402
from tensorfleet.ps import namespace_copy  # noqa: E402
from tensorfleet.ps.model_namespace import ModelClaim, fingerprint  # noqa: E402
from tensorfleet.ps.model_router import ModelRouter  # noqa: E402
from tensorfleet.ps.placement import VariableSpec, plan_placement  # noqa: E402
from tensorfleet.ps.service import ServiceConfig  # noqa: E402
from tensorfleet.ps.update_discipline import UpdateDiscipline  # noqa: E402
from tensorfleet.wire.service_socket import ServiceSocket  # noqa: E402
from tensorfleet.worker.client import ParameterClient  # noqa: E402
from tensorfleet.worker.namespace_control import NamespaceControl  # noqa: E402
from tensorfleet.worker.timeouts import ClientTimeouts  # noqa: E402


def _load_example():
    spec = importlib.util.spec_from_file_location(
        "pbt_schedule", ROOT / "examples" / "pbt_schedule.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def copy_row(params: int, repeats: int) -> dict:
    """Round trips of copy_model and of pull for a member of ``params`` parameters (Adam)."""
    secret = secrets.token_bytes(32)
    address = f"127.0.0.1:{_free_port()}"
    workers = ("worker:0", "worker:1")
    config = ServiceConfig(0, workers, idle_timeout_s=300.0, end_grace_s=5.0)
    socket = ServiceSocket(address, secret, config.limits)
    router = ModelRouter(socket, config)
    stop = threading.Event()
    thread = threading.Thread(target=router.serve, args=(stop,), daemon=True)
    thread.start()
    timeouts = ClientTimeouts(connect_s=30.0, initialize_s=30.0, step_s=60.0)
    # Two variables, as a model's layers: a weight of most parameters and a bias.
    shapes = {"weight": (params - 1000,), "bias": (1000,)}
    digest, summary = fingerprint([(n, s, "float32") for n, s in shapes.items()])
    plan = plan_placement([VariableSpec(n, s, "float32", 4) for n, s in shapes.items()], 1)
    clients, tensors = [], []
    control = None
    try:
        for i, task in enumerate(workers):
            named = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in shapes.items()]
            claim = ModelClaim(f"member-{i}", (task,), digest, summary)
            client = ParameterClient([address], secret, task, timeouts, model=claim)
            client.connect()
            client.register(
                named, plan, Adam(lr=1e-3), is_chief=True, discipline=UpdateDiscipline()
            )
            for _, p in named:
                p.grad = torch.randn_like(p)
            client.push_pull()  # Adam's moments exist from the first update on
            clients.append(client)
            tensors.append(named)
        control = NamespaceControl([address], secret, timeout_s=60.0)
        copies, pulls = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            control.copy_model("member-0", "member-1")
            copies.append(time.perf_counter() - start)
            start = time.perf_counter()
            clients[1].pull()
            pulls.append(time.perf_counter() - start)
        stop.set()
        thread.join(10.0)  # the loop is stopped: the services are this thread's now
        source, target = router.models["member-0"], router.models["member-1"]
        direct = []
        for _ in range(repeats):
            start = time.perf_counter()
            namespace_copy.copy_model(source, target)
            direct.append(time.perf_counter() - start)
        copy_ms, pull_ms = statistics.median(copies) * 1e3, statistics.median(pulls) * 1e3
        return {
            "params": params,
            "state_bytes": params * 4 * 3,
            "repeats": repeats,
            "copy_round_trip_ms": copy_ms,
            "copy_on_ps_ms": statistics.median(direct) * 1e3,
            "pull_round_trip_ms": pull_ms,
            "copy_to_pull": copy_ms / pull_ms,
        }
    finally:
        stop.set()
        if control is not None:
            control.close()
        for client in clients:
            client.close()
        thread.join(10.0)
        socket.close()


def pbt_row(seeds: int, rounds: int, steps_per_round: int) -> dict:
    """PBT vs the same members with fixed learning rates, per seed."""
    example = _load_example()
    runs = []
    for seed in range(seeds):
        scores = {}
        for exploit in (True, False):
            config = example.config(rounds, steps_per_round, seed)
            config.exploit = exploit
            with tempfile.TemporaryDirectory() as directory:
                start = time.perf_counter()
                result = run_pbt(config, directory, example.make_problem(seed))
                wall = time.perf_counter() - start
                if exploit and seed == 0 and (Path(directory) / "lineage.png").exists():
                    results_dir().mkdir(parents=True, exist_ok=True)
                    shutil.copy(Path(directory) / "lineage.png", results_dir() / "pbt_lineage.png")
            scores["pbt" if exploit else "fixed"] = {
                "best_score": result.best_score,
                "best_hyperparameters": result.best_hyperparameters,
                "scores": result.scores,
                "exploits": len(result.lineage.exploits()),
                "wall_s": wall,
            }
        scores["seed"] = seed
        scores["fixed_to_pbt"] = scores["fixed"]["best_score"] / scores["pbt"]["best_score"]
        runs.append(scores)
    return {
        "problem": "examples/pbt_schedule.py (noisy linear regression, SGD, lr searched)",
        "members": 4,
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "initial_lrs": example.LEARNING_RATES,
        "runs": runs,
        "pbt_wins": sum(r["fixed_to_pbt"] > 1 for r in runs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copy-params", type=int, default=1_000_000)
    parser.add_argument("--copy-repeats", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps-per-round", type=int, default=25)
    add_out_dir_option(parser)
    args = parser.parse_args()
    if args.copy_params < 2000 or args.copy_repeats < 1 or args.seeds < 1 or args.rounds < 2:
        parser.error(
            "needs --copy-params >= 2000, --copy-repeats >= 1, --seeds >= 1, --rounds >= 2"
        )
    torch.set_num_threads(1)
    result = {"copy": copy_row(args.copy_params, args.copy_repeats)}
    c = result["copy"]
    table = [
        "| measurement | baseline | tensorfleet | ratio |",
        "|---|---|---|---|",
        f"| exploit copy of a member of {c['params']:,} float32 parameters with Adam's state "
        f"({c['state_bytes'] / 2**20:.1f} MiB), median of {c['repeats']} (ms) | pull of its "
        f"values: {c['pull_round_trip_ms']:.1f} | copy_model round trip: "
        f"{c['copy_round_trip_ms']:.1f} (on the ps: {c['copy_on_ps_ms']:.1f}) | "
        f"{c['copy_to_pull']:.2f}x |",
    ]
    result["pbt"] = pbt_row(args.seeds, args.rounds, args.steps_per_round)
    p = result["pbt"]
    for run in p["runs"]:
        fixed, pbt = run["fixed"], run["pbt"]
        table.append(
            f"| PBT, 4 members x {p['rounds']} rounds x {p['steps_per_round']} steps, seed "
            f"{run['seed']} (best final score, lower is better) | best of 4 fixed lrs: "
            f"{fixed['best_score']:.4f} (lr {fixed['best_hyperparameters']['lr']:.4g}; "
            f"{fixed['wall_s']:.1f} s) | PBT: {pbt['best_score']:.4f} (final lr "
            f"{pbt['best_hyperparameters']['lr']:.4g}, {pbt['exploits']} exploits; "
            f"{pbt['wall_s']:.1f} s) | {run['fixed_to_pbt']:.2f}x |"
        )
    table.append(
        f"\n(PBT beat the best fixed learning rate on {p['pbt_wins']} of {len(p['runs'])} seeds)"
    )
    write_results("pbt", result, f"Population-based training ({os.cpu_count()} CPUs)", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
