"""The worker of ``benchmarks/sparse_tables.py``: an embedding of ``--rows`` x ``--dim``
followed by a linear head, trained on ids drawn uniformly (``--batch`` ids per step), either
as a ``tfl.EmbeddingTable`` whose rows live on the ps shards (``--kind sparse``), as a
dense ``nn.Embedding`` parameter pulled and pushed whole every step (``--kind dense``), or
as an ``nn.Embedding(sparse=True)`` whose weight the ps holds as rows and every worker
mirrors whole (``--kind mirrored``: each step pushes the touched rows' gradient and pulls
the rows changed since the last pull), or as a raw-id table (``--kind growing``: ids
arriving over time, half of each batch new ids, rows evicted after ``--expire-after-steps``
steps unseen; the worker reports the rows live halfway and at the end).

    sparse_table_worker.py OUT --kind sparse --rows 1000000 --dim 64 --batch 1024 --steps 100

It writes OUT (JSON): the time the session took to start (``start_s``: for ``mirrored``
the chief sends every row of its weight to the shards), the median time of a step after
``--warmup`` steps, the bytes this
worker's transport sent and received per step (``ParameterClient.wire_bytes``: requests and
replies, payloads included, counted by the channels), the unique ids per step, the loss
before and after, and this process's resident memory (``VmRSS`` now, ``VmHWM`` its peak).

``--precreate``: before training, the worker pulls every row of the table, shard after
shard, in chunks, so that the ps holds the whole table (rows are otherwise created on first
use); the table then starts from zeros (``RowInitializer("zeros")``), since computing the
normal initializer of 20M rows would take minutes of CPU on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

PRECREATE_CHUNK = 65_536
MARK = "sparse_tables: "  # the driver samples the ps's memory at a line starting so


def rows_live(sess: tfl.TrainingSession) -> int:
    """The table's rows live on all the shards now."""
    return sum(s["tables"]["embedding"]["rows_live"] for s in sess.cluster_stats())


class Net(nn.Module):
    def __init__(
        self, kind: str, rows: int, dim: int, zeros: bool, expire_after_steps: int | None = None
    ) -> None:
        super().__init__()
        if kind == "growing":  # a row per raw id, evicted after expire_after_steps unseen
            self.embedding = tfl.EmbeddingTable(
                rows, dim, name="embedding", ids="raw", expire_after_steps=expire_after_steps
            )
        elif kind == "sparse":
            initializer = tfl.RowInitializer("zeros") if zeros else tfl.RowInitializer()
            self.embedding: nn.Module = tfl.EmbeddingTable(
                rows, dim, name="embedding", initializer=initializer
            )
        else:  # dense: the whole table moves; mirrored: the rows a step touches
            self.embedding = nn.Embedding(rows, dim, sparse=kind == "mirrored")
            nn.init.normal_(self.embedding.weight, std=0.01)
        self.out = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embedding(ids)).squeeze(-1)


def memory_kib() -> dict[str, int]:
    """This process's ``VmRSS`` and ``VmHWM`` (KiB) from ``/proc/self/status``."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def batch(
    step: int, rows: int, size: int, growing: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of step ``step`` (uniform in [0, rows); ``growing``: ids arriving over time,
    half of each batch new, half the previous step's new ones) and their targets (a function
    of the id)."""
    if growing:
        ids = torch.arange(step * size // 2, step * size // 2 + size, dtype=torch.int64)
        return ids, ((ids % 7).to(torch.float32) - 3.0) / 3.0
    ids = torch.randint(0, rows, (size,), generator=torch.Generator().manual_seed(step))
    return ids, ((ids % 7).to(torch.float32) - 3.0) / 3.0


def precreate(model: Net) -> float:
    """Pull every row of the table, shard after shard (so that one ps grows at a time)."""
    table = model.embedding
    assert isinstance(table, tfl.EmbeddingTable)
    started = time.perf_counter()
    source, partition = table._source, table.partition
    for shard in range(partition.num_shards):
        ids = torch.arange(table.num_rows, dtype=torch.int64)
        mine = ids[partition.shard_of(ids) == shard]
        del ids
        for start in range(0, mine.numel(), PRECREATE_CHUNK):
            source.pull_rows(table.spec().name, shard, mine[start : start + PRECREATE_CHUNK])
        del mine
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kind", choices=("sparse", "dense", "mirrored", "growing"), required=True)
    parser.add_argument("--expire-after-steps", type=int, help="kind growing (default: never)")
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--precreate", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tfl.resolve_task(argv=[])
    server = tfl.Server(task.cluster, task.job, task.index)
    torch.manual_seed(0)
    model = Net(args.kind, args.rows, args.dim, args.precreate, args.expire_after_steps)
    growing = args.kind == "growing"
    total = args.warmup + args.steps
    report: dict[str, object] = {"kind": args.kind, "rows": args.rows, "dim": args.dim}
    session = tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.SGD(lr=args.lr),
        mode="async",
        hooks=[tfl.StopAtStep(last_step=total)],
    )
    started = time.perf_counter()
    with session as sess:
        report["start_s"] = time.perf_counter() - started
        client = sess._updater.client  # the benchmark reads the transport's byte counters
        if args.precreate:
            report["precreate_s"] = precreate(model)
            report["memory_after_precreate_kib"] = memory_kib()
        eval_ids, eval_y = batch(10**9, args.rows, 4096)
        if growing:  # the ids of the last steps: rows that are live at the end
            eval_ids, eval_y = batch(total - 1, args.rows, args.batch, growing)

        def loss_of(ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(sess.model(ids), y)

        with torch.no_grad():
            report["loss_before"] = loss_of(eval_ids, eval_y).item()
        times, unique = [], []
        sent0 = received0 = 0
        step = 0
        while not sess.should_stop():
            if step == args.warmup:
                sent0, received0 = client.wire_bytes()
            if growing and step == total // 2:
                print(f"{MARK}halfway", flush=True)  # the driver reads the ps's memory
                report["rows_live_halfway"] = rows_live(sess)
            ids, y = batch(step, args.rows, args.batch, growing)
            unique.append(torch.unique(ids).numel())
            started = time.perf_counter()
            sess.step(lambda ids=ids, y=y: loss_of(ids, y))
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
            step += 1
        sent, received = client.wire_bytes()
        measured = len(times)
        print(f"{MARK}trained", flush=True)  # the driver reads the ps's memory now
        if growing:
            report["rows_live"] = rows_live(sess)
        sess.pull()
        with torch.no_grad():
            report["loss_after"] = loss_of(eval_ids, eval_y).item()
        report.update(
            steps=measured,
            step_ms_median=statistics.median(times) * 1e3,
            sent_bytes_per_step=(sent - sent0) / measured,
            received_bytes_per_step=(received - received0) / measured,
            unique_ids_per_step=statistics.mean(unique),
            memory_kib=memory_kib(),
        )
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
