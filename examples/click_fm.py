"""A factorization machine on synthetic click data, with its 1M-row embedding table on the ps.

    tensorfleet launch --ps 2 --workers 2 -- python examples/click_fm.py --steps 600

Data from a known model, so that what is learned can be checked: each example has a user
id and an item id, both in [0, 1_000_000) (drawn with a Zipf-like skew, as real ids are);
each id belongs to one of 8 hidden groups (``id % 8``) with a known 4-d latent vector, and
the click probability is ``sigmoid(2 * <latent(user), latent(item)>)``. The model is a
factorization machine whose one table of 1M rows x 8 (``tfl.EmbeddingTable``) lives
row-partitioned on the ps shards: a step pulls and pushes only the rows of its batch, and
no worker ever holds the table. The chief prints log-loss and AUC on held-out examples,
and those of the known model (the best any model can do) for comparison.

``--raw-ids``: the ids are spread over the whole int64 range (each id multiplied by an odd
64-bit constant, a bijection, so nothing collides) and the table is
``tfl.EmbeddingTable(ROWS, DIM, ids="raw", admit_after=N, expire_after_steps=T)``: a row per
id at its first lookup, as the table of row numbers gives it, never evicted (the defaults:
the table's capacity holds every id this data brings, and both mechanisms cost accuracy
here, see docs/sparse.md); ``--admit-after N`` gives an id its row only once N updates
carried it (its gradients until then are dropped), ``--expire-after-steps T`` evicts a row
after T steps unseen. The chief also prints the table's numbers from ``cluster_stats()``
(rows live, admitted, evicted, gradient rows dropped).

    tensorfleet launch --ps 2 --workers 2 -- python examples/click_fm.py --steps 600 --raw-ids
    tensorfleet launch --ps 2 --workers 2 -- python examples/click_fm.py --steps 300 --raw-ids \
        --admit-after 2 --expire-after-steps 200

``--rows-ahead``: every worker calls ``model.embedding.create_all_rows()`` as its session
starts, so that the ps shards hold the whole table before the first step, as an
``nn.Embedding`` is whole from its constructor (each row created once, by whichever call
reaches its shard first; each worker prints how many its call created). ``--prefetch``: the
session's ``overlap=tfl.Overlap(prefetch=True)``: a step does not wait for its replies (the
dense values at most one step stale; the rows never, docs/timeline.md).

    tensorfleet launch --ps 2 --workers 2 -- python examples/click_fm.py --rows-ahead --prefetch
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

ROWS, DIM, GROUPS, BATCH = 1_000_000, 8, 8, 256


def latent(ids: torch.Tensor) -> torch.Tensor:
    """The known model's vector of each id: its group's fixed 4-d vector."""
    table = torch.randn(GROUPS, 4, generator=torch.Generator().manual_seed(0))
    return table[ids % GROUPS]


def make_clicks(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` examples: ids [n, 2] (user, item), labels [n], the true click probabilities."""
    generator = torch.Generator().manual_seed(seed)
    skew = torch.rand(n, 2, generator=generator) ** 10  # most ids small: they recur
    ids = (skew * ROWS).long().clamp_(max=ROWS - 1)
    probability = torch.sigmoid(2 * (latent(ids[:, 0]) * latent(ids[:, 1])).sum(1))
    labels = torch.bernoulli(probability, generator=generator)
    return ids, labels, probability


class FactorizationMachine(nn.Module):
    """``bias + scale * <v_user, v_item>``; user ids use the table's rows as they are, item ids too
    (one shared table, as one field space)."""

    def __init__(self, raw: dict[str, int | None] | None = None) -> None:
        super().__init__()
        self.embedding = tfl.EmbeddingTable(
            ROWS, DIM, initializer=tfl.RowInitializer("normal", 0.1, seed=1), **(raw or {})
        )
        self.bias = nn.Parameter(torch.zeros(1))
        # The learned weight of the interaction term.
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        vectors = self.embedding(ids)  # [batch, 2, DIM]
        return self.bias + self.scale * (vectors[:, 0] * vectors[:, 1]).sum(1)


def spread(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` over the whole int64 range: times an odd 64-bit constant, modulo 2**64 (a
    bijection: distinct ids stay distinct)."""
    wide = ids.numpy().astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return torch.from_numpy(wide.view(np.int64))


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (the probability a click outranks a non-click)."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    positives = labels.bool()
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--raw-ids", action="store_true", help="ids over int64, a row per id")
    parser.add_argument(
        "--admit-after", type=int, default=0, help="--raw-ids: a row after N updates (0: at once)"
    )
    parser.add_argument(
        "--expire-after-steps", type=int, help="--raw-ids: evict rows unseen for T steps (never)"
    )
    parser.add_argument(
        "--rows-ahead", action="store_true", help="create every row before the first step"
    )
    parser.add_argument(
        "--prefetch", action="store_true", help="a step does not wait for its replies"
    )
    args = parser.parse_args()
    if args.raw_ids and args.rows_ahead:
        parser.error("--rows-ahead creates the rows of a table of row numbers; with --raw-ids "
                     "a row is created per id seen: drop one of the two")  # fmt: skip
    torch.set_num_threads(1)
    task = tfl.resolve_task()
    server = tfl.Server(task.cluster, task.job, task.index)
    raw = None
    if args.raw_ids:
        raw = {
            "ids": "raw",
            "admit_after": args.admit_after,
            "expire_after_steps": args.expire_after_steps,
        }
    ids_of = spread if args.raw_ids else (lambda ids: ids)
    model = FactorizationMachine(raw)
    with tfl.TrainingSession(
        server, model, optimizer=tfl.optim.Adagrad(lr=args.lr), mode="async",
        hooks=[tfl.StopAtStep(last_step=args.steps)], log_placement=True,
        **({"overlap": tfl.Overlap(prefetch=True)} if args.prefetch else {}),
    ) as sess:  # fmt: skip
        if args.rows_ahead:  # every worker asks; a row is created once, by the first call
            print(f"rows created ahead: {model.embedding.create_all_rows():,d}", flush=True)
        seed = 1000 + task.rank
        batch = make_clicks(BATCH, seed)
        while not sess.should_stop():
            seed += task.num_workers
            upcoming = make_clicks(BATCH, seed)
            # The next batch's rows ride with this step's exchange (docs/sparse.md).
            model.embedding.prefetch(ids_of(upcoming[0]))
            ids, labels = ids_of(batch[0]), batch[1]
            sess.step(
                lambda ids=ids, labels=labels: F.binary_cross_entropy_with_logits(
                    model(ids), labels
                )
            )
            batch = upcoming
        ahead = model.embedding.lookups_ahead  # before the evaluation's lookup below
        print(f"lookups sent ahead: {ahead['used']} used, {ahead['missed']} missed", flush=True)
        if sess.is_chief:
            sess.pull()
            ids, labels, probability = make_clicks(20_000, seed=7)  # held out
            with torch.no_grad():
                scores = model(ids_of(ids))
            if args.raw_ids:
                shards = [s["tables"]["embedding"] for s in sess.cluster_stats()]
                print(
                    "raw-id table: "
                    + ", ".join(
                        f"{sum(s[key] for s in shards):,d} {key.replace('_', ' ')}"
                        for key in ("rows_live", "admitted", "evicted", "dropped_rows")
                    ),
                    flush=True,
                )
            loss = F.binary_cross_entropy_with_logits(scores, labels).item()
            best = F.binary_cross_entropy(probability, labels).item()
            print(
                f"held-out: log-loss {loss:.4f} (known model {best:.4f}, "
                f"constant {F.binary_cross_entropy(labels.mean().expand_as(labels), labels):.4f}); "
                f"AUC {auc(scores, labels):.4f} (known model {auc(probability, labels):.4f})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
