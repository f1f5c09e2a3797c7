"""Devices benchmarks, each against a baseline measured in the same run.

1. **Thread budget** (``budget``): the example's CNN on a local 1 ps + 3 worker cluster, global
   steps/s with the launcher's per-task thread budget (the host's cores divided among the 4
   tasks, at least 1 each) vs. every task using every core (torch's default: the
   oversubscription the budget replaces). Alternating pairs, median of the ratios.
2. **Pipeline across 2 tasks** (``pipeline``): an MLP 784-1024-1024-1024-10 (2.9M params,
   batch 256, 4 micro-batches, SGD), steps/s of a 2-stage pipeline over gloo (2 processes x
   1 thread: torch's 1F1B and GPipe schedules, and the leader-driven GPipe of
   ``tensorfleet.parallel.driven_pipeline`` with the stage exchange a ps replica needs) vs.
   one process with 1 thread and with 2 threads. The bubble: each stage's compute time
   (its forward + backward of the 4 micro-batches, timed alone in this process, 1 thread)
   over the pipeline's wall time per step gives each stage's busy share; the rest is idle
   (the schedule's bubble, ``(p-1)/(n+p-1)`` = 20 % in theory, plus stage imbalance and
   gloo copies).

    .venv/bin/python benchmarks/devices.py [--only budget|pipeline] [--steps N]

Writes benchmarks/results/devices.json and .md; ``--only PART`` writes ``devices_PART``
(a partial run never replaces the whole table). On a shared or small machine the figures
are noisy: say "measured under load" when quoting them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet import environment  # noqa: E402
from tensorfleet.cluster.resources import plan_resources  # noqa: E402
from tensorfleet.launch.local_cluster import LocalCluster  # noqa: E402
from tensorfleet.launch.output import Output  # noqa: E402
from tensorfleet.launch.ports import free_port  # noqa: E402
from tensorfleet.parallel.stages import split_stages  # noqa: E402

BATCH, MICROBATCHES, BOUNDARY = 256, 4, [4]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )  # fmt: skip


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))) for _ in range(count)]


# ------------------------------------------------------------------------ thread budget


def cnn_run(steps: int, budget: bool) -> float:
    """Global steps/s of the CNN (the chief's, after a warm-up) on 1 ps + 3 workers, async,
    with or without the budget."""
    cores = environment.host_cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", "cnn", "--steps", str(steps),
                   "--out", str(result)]  # fmt: skip
        task_env = None
        if budget:
            task_env = {n: r.to_env() for n, r in plan_resources(1, 3, host_cores=cores).items()}
        else:  # every task uses every core: what a script without thread settings gets
            command += ["--threads", str(cores)]
        cluster = LocalCluster(
            1, 3, command, ps_command=command, task_env=task_env, output=Output(), grace_period=20
        )
        try:
            cluster.start()
            code = cluster.wait(timeout=1800)
        finally:
            cluster.stop()
        if code != 0:
            raise RuntimeError(
                f"the cluster run failed ({code}): {cluster.recent_lines('worker:0')}"
            )
        return json.loads(result.read_text())["global_steps_per_s"]


def cnn_child(steps: int, threads: int | None, out: str) -> int:
    """One task of the CNN run: a ps serves; a worker trains the example's CNN (async, Adam
    1e-4, batch 50) and the chief writes its steady global steps/s to ``out``."""
    import tensorfleet as tfl
    from tensorfleet.datasets import BatchStream, load_mnist, normalize

    sys.path.insert(0, str(ROOT / "examples"))
    from mnist_cnn import ClassicCNN

    if threads is not None:
        torch.set_num_threads(threads)
        torch.set_num_interop_threads(threads)
    task = tfl.resolve_task(argv=[])
    server = tfl.Server(task.cluster, task.job, task.index)  # applies a budget, if any
    if task.job == "ps":
        server.join()
        return 0
    images, labels = load_mnist("fashion-mnist", None, "train")
    batches = BatchStream(normalize(images), labels, 50, shard_index=task.index, num_shards=3)
    torch.manual_seed(0)
    model = ClassicCNN()
    warmup, start_step, start = 30, None, 0.0
    with tfl.TrainingSession(
        server, model, optimizer=tfl.optim.Adam(lr=1e-4), hooks=[tfl.StopAtStep(steps)]
    ) as sess:
        while not sess.should_stop():
            x, y = next(batches)
            result = sess.step(lambda x=x, y=y: F.cross_entropy(model(x), y))
            if start_step is None and result.global_step >= warmup:
                start_step, start = result.global_step, time.perf_counter()
        if sess.is_chief and start_step is not None:
            rate = (sess.global_step - start_step) / (time.perf_counter() - start)
            Path(out).write_text(json.dumps({"global_steps_per_s": rate}))
    return 0


def budget_rows(steps: int, pairs: int) -> dict:
    budgeted, oversubscribed, ratios = [], [], []
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {b: cnn_run(steps, b) for b in order}
        budgeted.append(got[True])
        oversubscribed.append(got[False])
        ratios.append(got[True] / got[False])
        print(
            f"pair {i}: budget {got[True]:.2f} steps/s, oversubscribed {got[False]:.2f}", flush=True
        )
    return {
        "cnn_thread_budget": {"steps_per_s": statistics.median(budgeted)},
        "cnn_oversubscribed": {"steps_per_s": statistics.median(oversubscribed)},
        "budget_vs_oversubscribed_median_ratio": statistics.median(ratios),
    }


# ------------------------------------------------------------------------ pipeline


def single_process(steps: int, threads: int) -> float:
    torch.set_num_threads(threads)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = batches(4)
    for i in range(3):
        x, y = data[i % 4]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    start = time.perf_counter()
    for i in range(steps):
        x, y = data[i % 4]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return steps / (time.perf_counter() - start)


def stage_compute_seconds(repeats: int = 5) -> list[float]:
    """Each stage's forward + backward of all micro-batches, alone, 1 thread (median)."""
    torch.set_num_threads(1)
    stages = split_stages(mlp(), boundaries=BOUNDARY)
    mb = BATCH // MICROBATCHES
    x = torch.randn(mb, 784)
    y = torch.randint(0, 10, (mb,))
    with torch.no_grad():
        mid = stages[0](x)
    out = []
    for s, stage in enumerate(stages):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(MICROBATCHES):
                if s == 0:
                    stage(x).backward(torch.ones(mb, mid.shape[1]))
                else:
                    inp = mid.clone().requires_grad_(True)
                    F.cross_entropy(stage(inp), y).backward()
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out


def pipeline_run(kind: str, steps: int) -> float:
    """Seconds per step of a 2-process pipeline of ``kind`` (measured by rank 0)."""
    rendezvous = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                kind,
                "--rank",
                str(r),
                "--rendezvous",
                rendezvous,
                "--steps",
                str(steps),
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"pipeline {kind} failed:\n" + "\n".join(outs))
    figures = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
    return figures[0]["seconds_per_step"]


def child(kind: str, rank: int, rendezvous: str, steps: int) -> int:
    from tensorfleet.parallel.driven_pipeline import PipelineLeader, PipelinePlan, serve_stage
    from tensorfleet.parallel.remote_pipeline import RemotePipelineStage, join_process_group
    from tensorfleet.parallel.stage_exchange import StageControl

    torch.set_num_threads(1)
    join_process_group(rendezvous, rank, 2, timeout_s=120)
    model = mlp()
    data = batches(4)
    warmup = 3
    if kind == "driven":
        names = ("stage 0", "stage 1")
        if rank == 1:
            serve_stage(model, 1, names)
        else:
            leader = PipelineLeader(model, PipelinePlan(tuple(BOUNDARY), MICROBATCHES, names))
            leader.configure()
            module = leader.module()
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            start = 0.0
            for i in range(steps + warmup):
                if i == warmup:
                    start = time.perf_counter()
                x, y = data[i % 4]
                opt.zero_grad()
                F.cross_entropy(module(x), y).backward()
                leader.gather_gradients()
                opt.step()
                leader.send_values(StageControl(i + 1, False, True))
            elapsed = time.perf_counter() - start
            leader.end()
            print(json.dumps({"seconds_per_step": elapsed / steps}), flush=True)
    else:
        stage = RemotePipelineStage(
            split_stages(model, boundaries=BOUNDARY)[rank], rank, 2,
            n_microbatches=MICROBATCHES, loss_fn=F.cross_entropy, schedule=kind,
        )  # fmt: skip
        opt = torch.optim.SGD(stage.module.parameters(), lr=0.05)
        start = 0.0
        for i in range(steps + warmup):
            if i == warmup:
                start = time.perf_counter()
            x, y = data[i % 4]
            stage.step(x if rank == 0 else None, y if rank == 1 else None)
            opt.step()
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(json.dumps({"seconds_per_step": elapsed / steps}), flush=True)
    torch.distributed.destroy_process_group()
    return 0


def pipeline_rows(steps: int) -> dict:
    rows: dict = {}
    for threads in (1, 2):
        rows[f"mlp_one_process_{threads}_thread"] = {"steps_per_s": single_process(steps, threads)}
        print(rows, flush=True)
    compute = stage_compute_seconds()
    rows["stage_compute_seconds_per_step"] = compute
    for kind in ("1f1b", "gpipe", "driven"):
        seconds = pipeline_run(kind, steps)
        rows[f"mlp_pipeline_2_tasks_{kind}"] = {
            "steps_per_s": 1 / seconds,
            "busy_share_per_stage": [c / seconds for c in compute],
            "idle_share_per_stage": [1 - c / seconds for c in compute],
        }
        print(kind, rows[f"mlp_pipeline_2_tasks_{kind}"], flush=True)
    rows["bubble_theory"] = (2 - 1) / (MICROBATCHES + 2 - 1)
    return rows


def results_name(only: str | None) -> str:
    """The results' file name: ``devices`` for the whole run, ``devices_<part>`` for
    ``--only <part>``, so that a partial run never replaces the whole table."""
    return "devices" if only is None else f"devices_{only}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=("budget", "pipeline"))
    parser.add_argument(
        "--steps", type=int, default=0, help="steps per run (default: 300 CNN, 40 MLP)"
    )
    parser.add_argument(
        "--pairs", type=int, default=2, help="alternating budget/oversubscribed pairs"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    add_out_dir_option(parser)
    args = parser.parse_args()
    if args.child == "cnn":
        return cnn_child(args.steps, args.threads, args.out)
    if args.child:
        return child(args.child, args.rank, args.rendezvous, args.steps)

    rows: dict = {}
    if args.only in (None, "budget"):
        rows.update(budget_rows(args.steps or 300, args.pairs))
    if args.only in (None, "pipeline"):
        rows.update(pipeline_rows(args.steps or 40))
    result = {
        "benchmark": "devices: thread budget (CNN, 1 ps + 3 workers) and a 2-task pipeline (MLP)",
        "machine": {
            "cpus": environment.host_cpu_count(),
            "torch": torch.__version__,
            "load_average_at_end": os.getloadavg(),
        },  # fmt: skip
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    table = ["| run | steps/s | ratio vs baseline | notes |", "|---|---|---|---|"]
    if "cnn_oversubscribed" in rows:
        base = rows["cnn_oversubscribed"]["steps_per_s"]
        table.append(
            f"| CNN 1 ps + 3 workers, every task all cores (baseline) | {base:.2f} | 1.00x | |"
        )
        table.append(
            f"| CNN 1 ps + 3 workers, thread budget | {rows['cnn_thread_budget']['steps_per_s']:.2f} | "
            f"{rows['budget_vs_oversubscribed_median_ratio']:.2f}x | median of {args.pairs} alternating pairs |"
        )
    if "mlp_one_process_2_thread" in rows:
        base = rows["mlp_one_process_2_thread"]["steps_per_s"]
        for name in ("mlp_one_process_2_thread", "mlp_one_process_1_thread"):
            table.append(
                f"| {name} | {rows[name]['steps_per_s']:.2f} | {rows[name]['steps_per_s'] / base:.2f}x | |"
            )
        for kind in ("1f1b", "gpipe", "driven"):
            row = rows[f"mlp_pipeline_2_tasks_{kind}"]
            idle = ", ".join(
                f"stage {i} {v:.0%}" for i, v in enumerate(row["idle_share_per_stage"])
            )
            table.append(
                f"| mlp_pipeline_2_tasks_{kind} | {row['steps_per_s']:.2f} | "
                f"{row['steps_per_s'] / base:.2f}x | idle: {idle} (theory: bubble {rows['bubble_theory']:.0%}) |"
            )
    write_results(
        results_name(args.only), result, f"{result['benchmark']}, {result['date']}", table
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
