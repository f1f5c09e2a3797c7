"""The click model of ``examples/click_fm.py`` trained on a fixed data set, for
``benchmarks/sparse_tables.py``'s speed rows against a plain PyTorch loop.

    click_speed.py OUT --mode torch|local|cluster --optimizer adagrad|sparse_adam|sgd \
        [--examples 200000] [--epochs 2] [--rows-ahead] [--prefetch]

The data: ``--examples`` examples drawn once from the click model (``make_clicks``, seed 1),
visited ``--epochs`` times in batches of 256, each epoch in its own fixed random order; a
held-out set of 20,000 examples (seed 7) scores the trained model (AUC). Every mode sees the
same batches in the same order (cluster: worker ``r`` of ``W`` takes batches ``r, r+W, ...``).

* ``torch``: the plain PyTorch loop, ``nn.Embedding(1M, 8, sparse=True)`` and torch's
  optimizer (``adagrad``: ``torch.optim.Adagrad`` over every parameter; ``sparse_adam``:
  ``torch.optim.SparseAdam`` on the embedding and ``Adam`` on the rest; ``sgd``:
  ``torch.optim.SGD``);
* ``local``: the same model with a ``tfl.EmbeddingTable``, a ``TrainingSession`` without a
  cluster (``server=None``) with the matching ``tfl.optim`` rules;
* ``cluster``: the same session as a task of a ``tensorfleet`` cluster (``async``).

``--rows-ahead``: the table creates all its rows before the loop
(``EmbeddingTable.create_all_rows()``, as ``nn.Embedding`` initializes its weight in its
constructor) instead of at each row's first lookup; the CPU seconds that took are reported
as ``setup_cpu_s``, outside the loop's (``cluster``: the rows are created on the ps shards,
every worker asking before its loop; its own CPU seconds only). ``--prefetch`` (``cluster``): before each step the
table is told the next batch's ids (``EmbeddingTable.prefetch``), so that its lookup travels
with this step's exchange; the chief reports ``lookups_ahead``. ``--timeline DIR`` (``cluster``): each task writes its
Chrome trace there, and each worker reports its step's phases in milliseconds per step
(``phases``: the forward, the waits for the lookup's replies inside it, the backward, the
exchange).

Each process writes ``OUT`` (``cluster``: ``OUT.<rank>``, JSON): the wall-clock start and end
of its training loop (``time.time()``, comparable between the processes of one machine), the
CPU seconds it spent in the loop (``local``, ``cluster``: also by thread, ``cpu_s_threads``:
the loop's own thread, the channels' threads, ZeroMQ's I/O thread), the examples it trained on and (``torch``, ``local``, the
cluster's chief) the held-out AUC.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from click_fm import BATCH, DIM, ROWS, FactorizationMachine, auc, make_clicks  # noqa: E402

import tensorfleet as tfl  # noqa: E402

LR = {"adagrad": 0.1, "sparse_adam": 0.01, "sgd": 1.0}


class TorchFactorizationMachine(nn.Module):
    """The click model with a plain ``nn.Embedding(sparse=True)``: the PyTorch baseline."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(ROWS, DIM, sparse=True)
        nn.init.normal_(self.embedding.weight, std=0.1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        vectors = self.embedding(ids)
        return self.bias + self.scale * (vectors[:, 0] * vectors[:, 1]).sum(1)


def batches(examples: int, epochs: int) -> list[torch.Tensor]:
    """The positions of every batch of every epoch, in training order."""
    out = []
    for epoch in range(epochs):
        order = torch.randperm(examples, generator=torch.Generator().manual_seed(100 + epoch))
        out += list(order.split(BATCH))
    return out


def torch_optimizers(model: TorchFactorizationMachine, name: str) -> list[torch.optim.Optimizer]:
    lr = LR[name]
    if name == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=lr)]
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=lr)]
    return [
        torch.optim.SparseAdam([model.embedding.weight], lr=lr),
        torch.optim.Adam([model.bias, model.scale], lr=lr),
    ]


def session_rules(name: str) -> dict:
    lr = LR[name]
    if name == "adagrad":
        return {"optimizer": tfl.optim.Adagrad(lr=lr)}
    if name == "sgd":
        return {"optimizer": tfl.optim.SGD(lr=lr)}
    return {"optimizer": tfl.optim.Adam(lr=lr), "sparse_optimizer": tfl.optim.SparseAdam(lr=lr)}


def held_out_auc(model: nn.Module) -> float:
    ids, labels, _ = make_clicks(20_000, seed=7)
    with torch.no_grad():
        return auc(model(ids), labels)


def step_phases(trace: dict) -> dict[str, float]:
    """A worker's Chrome trace as milliseconds per step: the forward (``compute``, the
    lookup's request and wait included), the waits for replies inside it (the lookup's), the
    backward and the exchange."""
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    computes = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "compute")
    starts = [start for start, _ in computes]
    lookup_wait = 0.0
    for event in spans:
        if event["name"] != "wait":
            continue
        k = bisect.bisect_right(starts, event["ts"]) - 1  # the forward it began in, if any
        if k >= 0 and event["ts"] < computes[k][1]:
            lookup_wait += event["dur"]
    steps = max(1, len(computes))

    def per_step(name: str) -> float:
        return sum(e["dur"] for e in spans if e["name"] == name) / 1000 / steps

    return {
        "steps": len(computes),
        "forward_ms": per_step("compute"),
        "lookup_wait_ms": lookup_wait / 1000 / steps,
        "backward_ms": per_step("backward"),
        "exchange_ms": per_step("exchange"),
    }


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds each thread of this process has spent (``/proc/self/task``), by the
    thread's Python name where it has one and the kernel's (``ZMQbg/IO/0``, ...) where not:
    where a worker's CPU goes between the training loop's thread, the channels' threads and
    ZeroMQ's."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    seconds: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        comm, fields = stat.split("(", 1)[1].rsplit(")", 1)
        utime, stime = fields.split()[11:13]
        tid = int(task.name)
        name = names.get(tid) or ("MainThread" if tid == os.getpid() else comm)
        seconds[name] = seconds.get(name, 0.0) + (int(utime) + int(stime)) / tick
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=("torch", "local", "cluster"), required=True)
    parser.add_argument("--optimizer", choices=tuple(LR), required=True)
    parser.add_argument("--examples", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--profile",
        help="write a cProfile of the training loop there (the loop's thread's CPU time)",
    )
    parser.add_argument(
        "--rows-ahead", action="store_true", help="create every row before the loop"
    )
    parser.add_argument(
        "--prefetch", action="store_true", help="cluster: each lookup sent with the step before"
    )
    parser.add_argument(
        "--timeline", help="cluster: write each task's trace there and report the step's phases"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ids, labels, _ = make_clicks(args.examples, seed=1)
    plan = batches(args.examples, args.epochs)
    report: dict[str, object] = {"mode": args.mode, "optimizer": args.optimizer}
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)
    if args.mode == "torch":
        model = TorchFactorizationMachine()
        optimizers = torch_optimizers(model, args.optimizer)
        started, cpu = time.time(), time.process_time()
        if profiler:
            profiler.enable()
        for rows in plan:
            for optimizer in optimizers:
                optimizer.zero_grad()
            F.binary_cross_entropy_with_logits(model(ids[rows]), labels[rows]).backward()
            for optimizer in optimizers:
                optimizer.step()
        if profiler:
            profiler.disable()
        report.update(start=started, end=time.time(), cpu_s=time.process_time() - cpu)
        report.update(examples=args.examples * args.epochs, auc=held_out_auc(model))
        out, rank = Path(args.out), 0
    else:
        server, rank, workers = None, 0, 1
        if args.mode == "cluster":
            task = tfl.resolve_task(argv=[])
            server = tfl.Server(task.cluster, task.job, task.index)
            rank, workers = task.rank, task.num_workers
        model = FactorizationMachine()
        mine = plan[rank::workers]
        session = tfl.TrainingSession(
            server, model, mode="async", hooks=[tfl.StopAtStep(last_step=len(plan))],
            progress_secs=None, timeline=args.timeline, **session_rules(args.optimizer),
        )  # fmt: skip
        with session as sess:
            if args.rows_ahead:
                setup = time.process_time()
                model.embedding.create_all_rows()
                report["setup_cpu_s"] = time.process_time() - setup
            trained = 0
            started, cpu = time.time(), time.process_time()
            threads_before = thread_cpu_seconds()
            if profiler:
                profiler.enable()
            for k, rows in enumerate(mine):
                if sess.should_stop():
                    break
                if args.prefetch and k + 1 < len(mine):  # the next batch's rows ride ahead
                    model.embedding.prefetch(ids[mine[k + 1]])
                x, y = ids[rows], labels[rows]
                sess.step(lambda x=x, y=y: F.binary_cross_entropy_with_logits(model(x), y))
                trained += rows.numel()
            if profiler:
                profiler.disable()
            report.update(start=started, end=time.time(), cpu_s=time.process_time() - cpu)
            report["cpu_s_threads"] = {
                name: round(spent - threads_before.get(name, 0.0), 3)
                for name, spent in thread_cpu_seconds().items()
            }
            report["examples"] = trained
            report["lookups_ahead"] = model.embedding.lookups_ahead
            if sess.is_chief:
                sess.pull()
                report["auc"] = held_out_auc(model)
        if session.timeline_path is not None:  # written when the session ended
            report["phases"] = step_phases(json.loads(session.timeline_path.read_text()))
        out = Path(f"{args.out}.{rank}") if args.mode == "cluster" else Path(args.out)
    if profiler:
        profiler.dump_stats(f"{args.profile}.{rank}" if args.mode == "cluster" else args.profile)
    out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
