"""A worker for the sparse-gradient test: a model with ``nn.Embedding(sparse=True)`` and
``nn.EmbeddingBag(sparse=True)`` learns labels that are a known function of the ids.

    sparse_embedding_worker.py OUT MODE STEPS [--max-staleness S] [--table] [--table-only]
        [--prefetch] [--rows-ahead] [--overlap-prefetch] [--checkpoint-dir D]
        [--optimizer sgd|adagrad|sparse_adam]

``--table``: the first lookup is a ``tfl.EmbeddingTable`` whose rows live on the ps shards.
``--table-only``: the model is that table and a linear head (2 dense variables), so that on
3 ps or more some shard holds only table rows. ``--optimizer sparse_adam``: Adam for the
head and lazy Adam (``sparse_optimizer``) for the sparse weights. ``--rows-ahead``: every
worker calls ``EmbeddingTable.create_all_rows()`` right after the session started and writes
how many rows its call created to ``OUT.created.<index>``. ``--overlap-prefetch``: the session
has ``overlap=tfl.Overlap(prefetch=True)`` (a step does not wait for its replies); the chief's
OUT then also holds each shard's table update count after the session's last step
(``table_steps``, from ``cluster_stats()``) and the row pushes its worker dropped.

The chief writes OUT (JSON): the loss on all the data before and after training (with
``--table-only`` also the trained table's rows and the head's parameters). Without a table
every worker also writes ``OUT.<index>.json``: its copy of each sparse embedding weight
after a last pull, and whether that copy equals the rows the ps shards hold at the version
it pulled (``matches_ps``: compared bit for bit once a pull and a whole read of the shards'
rows find the same versions, which they do when the other worker no longer pushes).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

IDS, DIM, CLASSES, BATCH = 40, 4, 3, 16


class TableOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = tfl.EmbeddingTable(IDS, DIM, initializer=tfl.RowInitializer("normal", 1.0))
        self.out = nn.Linear(DIM, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embedding(ids[:, 0]))


class Net(nn.Module):
    def __init__(self, table: bool = False) -> None:
        super().__init__()
        self.embedding = (
            tfl.EmbeddingTable(IDS, DIM, initializer=tfl.RowInitializer("normal", 1.0))
            if table
            else nn.Embedding(IDS, DIM, sparse=True)
        )
        self.bag = nn.EmbeddingBag(IDS, DIM, mode="sum", sparse=True)
        self.out = nn.Linear(2 * DIM, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.embedding(ids[:, 0]), self.bag(ids)], dim=1))


def make_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, IDS, (n, 2), generator=generator)
    return ids, ids[:, 0] % CLASSES  # the label is a function of the first id


OPTIMIZERS = {
    "sgd": (tfl.optim.SGD(lr=2.0), None),
    "adagrad": (tfl.optim.Adagrad(lr=0.5), None),
    "sparse_adam": (tfl.optim.Adam(lr=0.05), tfl.optim.SparseAdam(lr=0.1)),
}


def mirror_matches_ps(sess: tfl.TrainingSession, attempts: int = 1000) -> bool:
    """Whether this worker's copies of the sparse embedding weights equal the shards' rows
    bit for bit at the versions it pulled (see the module docstring)."""
    mirrored = sess._updater.mirrored
    for _ in range(attempts):
        sess.pull()
        settled = True
        for weight in mirrored.weights:
            shards = range(weight.partition.num_shards)
            whole = mirrored.source.pull_changed(
                weight.name, {k: (None, 0) for k in shards}, 1 << 20, weight.spec.dim
            )
            if any([whole[k].incarnation, whole[k].version] != weight.seen[k] for k in shards):
                settled = False  # another worker pushed in between: try again
                break
            rows = torch.full_like(weight.param.detach(), float("nan"))
            for k in shards:
                rows[whole[k].ids] = whole[k].values
            if not torch.equal(rows, weight.param.detach()):
                return False
        if settled:
            return True
    raise RuntimeError(f"the shards' versions did not settle in {attempts} attempts")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode")
    parser.add_argument("steps", type=int)
    parser.add_argument("--max-staleness", type=int, default=None)
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    parser.add_argument("--prefetch", action="store_true", help="--table-only: rows ahead")
    parser.add_argument(
        "--rows-ahead", action="store_true", help="--table-only: create_all_rows() first"
    )
    parser.add_argument("--overlap-prefetch", action="store_true", help="Overlap(prefetch=True)")
    args = parser.parse_args()
    optimizer, sparse_optimizer = OPTIMIZERS[args.optimizer]
    torch.set_num_threads(1)
    task = tfl.resolve_task(argv=[])
    server = tfl.Server(task.cluster, task.job, task.index)
    torch.manual_seed(3)
    model = TableOnly() if args.table_only else Net(args.table)
    ids, labels = make_data((args.steps + 16) * task.num_workers * BATCH)
    before = None
    with tfl.TrainingSession(
        server, model, optimizer=optimizer, mode=args.mode, sparse_optimizer=sparse_optimizer,
        hooks=[tfl.StopAtStep(last_step=args.steps)], max_staleness=args.max_staleness,
        checkpoint_dir=args.checkpoint_dir,
        **({"overlap": tfl.Overlap(prefetch=True)} if args.overlap_prefetch else {}),
    ) as sess:  # fmt: skip
        if args.rows_ahead:  # every worker asks; the rows one of them created are not again
            created = model.embedding.create_all_rows()
            with open(f"{args.out}.created.{task.index}", "w") as f:
                f.write(str(created))
        with torch.no_grad():  # a table can be read once the session attached it
            before = F.cross_entropy(model(ids), labels).item()
        while not sess.should_stop():
            start = (sess.global_step * task.num_workers + task.index) * BATCH
            xb, yb = ids[start : start + BATCH], labels[start : start + BATCH]
            if args.prefetch:  # the next step's batch (sync: the global step advances by 1)
                following = start + task.num_workers * BATCH
                model.embedding.prefetch(ids[following : following + BATCH, 0])
            sess.step(lambda xb=xb, yb=yb: F.cross_entropy(sess.model(xb), yb))
        if not args.table and not args.table_only:  # the weights mirrored from the ps rows
            mine = {
                "matches_ps": mirror_matches_ps(sess),
                "weights": {w.name: w.param.tolist() for w in sess._updater.mirrored.weights},
            }
            with open(f"{args.out}.{task.index}.json", "w") as f:
                json.dump(mine, f)
        if sess.is_chief:
            sess.pull()
            with torch.no_grad():
                after = F.cross_entropy(model(ids), labels).item()
                result = {"before": before, "after": after, "global_step": sess.global_step}
                if args.overlap_prefetch:  # every row push applied, none left in flight
                    stats = sess.cluster_stats()
                    result["table_steps"] = [
                        shard["tables"]["embedding"]["step"] for shard in stats
                    ]
                    result["dropped_row_pushes"] = sess._updater._row_source.dropped_pushes
                if args.table_only:  # the trained model, for a one-process reference
                    result["lookups_ahead"] = model.embedding.lookups_ahead
                    result["table"] = model.embedding(torch.arange(IDS)).tolist()
                    result["out"] = [p.tolist() for p in model.out.parameters()]
            with open(args.out, "w") as f:
                json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
