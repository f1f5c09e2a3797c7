"""An ``nn.Embedding(sparse=True)`` trained through the ps: its weight held as rows, pushed as rows.

    tensorfleet launch --ps 2 --workers 2 -- python examples/sparse_embedding.py --steps 300

Each example is one id in [0, 200_000) (drawn with a skew, as real ids are) whose target is
a known function of the id. The model is an ``nn.Embedding(200_000, 16, sparse=True)`` and a
small dense head. The ps shards hold the embedding's weight as rows (``r mod 2``); a step
pushes only the rows its batch touched (lazy Adam, ``sparse_optimizer``; Adam for the head)
and pulls only the rows changed since the last step into each worker's whole copy. The chief
prints the held-out loss before and after, then loads the final checkpoint strictly into a
fresh model: the weight comes back whole, reassembled from the shards' rows.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

ROWS, DIM, BATCH = 200_000, 16, 256


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(ROWS, DIM, sparse=True)  # held by the ps as rows
        self.head = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids)).squeeze(-1)


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = ((torch.rand(n, generator=generator) ** 4) * ROWS).long().clamp_(max=ROWS - 1)
    return ids, torch.sin(ids.float() * 0.37)  # a fixed target per id


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--mode", default="async", choices=["async", "sync"])
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where the chief keeps its checkpoints (default: a temporary directory, removed "
        "when the example ends)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tfl.resolve_task()
    server = tfl.Server(task.cluster, task.job, task.index)
    torch.manual_seed(0)
    model = Model()
    checkpoints = args.checkpoint_dir or tempfile.mkdtemp(prefix="sparse-embedding-")
    try:
        return train(args, task, server, model, checkpoints)
    finally:
        if args.checkpoint_dir is None:  # ours: nothing of it is left in /tmp
            shutil.rmtree(checkpoints, ignore_errors=True)


def train(
    args: argparse.Namespace,
    task: tfl.ResolvedTask,
    server: tfl.Server,
    model: nn.Module,
    checkpoints: str,
) -> int:
    """Train, then (the chief) load the final checkpoint strictly into a fresh model."""
    held_ids, held_y = make_data(4096, seed=10**6)
    with tfl.TrainingSession(
        server, model, optimizer=tfl.optim.Adam(lr=0.01), mode=args.mode,
        sparse_optimizer=tfl.optim.SparseAdam(lr=0.05),
        hooks=[tfl.StopAtStep(last_step=args.steps)], checkpoint_dir=checkpoints,
        log_placement=True,
    ) as sess:  # fmt: skip
        with torch.no_grad():
            before = F.mse_loss(model(held_ids), held_y).item()
        seed = task.index
        while not sess.should_stop():
            ids, y = make_data(BATCH, seed)
            seed += task.num_workers
            sess.step(lambda ids=ids, y=y: F.mse_loss(sess.model(ids), y))
        sess.pull()
        with torch.no_grad():
            after = F.mse_loss(model(held_ids), held_y).item()
    if sess.is_chief:  # the session wrote the final checkpoint when it closed
        fresh = Model()
        state = tfl.load_checkpoint(checkpoints, fresh)  # strict: the weight comes back whole
        print(
            f"held-out mse: before {before:.4f}, after {after:.4f}; the checkpoint's "
            f"embedding.weight is {list(state['embedding.weight'].shape)}, loaded strictly",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
