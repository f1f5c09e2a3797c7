"""A worker for the buffer tests: a small MLP with BatchNorm (running statistics,
``num_batches_tracked``, a user buffer registered as persistent and one that is not) trained
for a fixed number of steps, each worker on its own slice of every global batch.

    bn_worker.py OUT MODE STEPS CHECKPOINT_DIR

Every worker writes OUT.<task index>.json: its model's state_dict after training (the chief
pulls first, in async mode once the others have written theirs, so its state is the shared
one the final checkpoint holds), and after one more forward pass through the
session's model in eval mode (in allreduce mode DDP broadcasts rank 0's buffers there).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

FEATURES, HIDDEN, CLASSES, BATCH = 6, 8, 3, 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)
        self.register_buffer("seen", torch.zeros(1))  # a user's persistent buffer
        self.register_buffer("scratch", torch.zeros(1), persistent=False)  # stays local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += 1
            self.scratch += 1
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def make_model() -> nn.Module:
    torch.manual_seed(7)
    return Net()


def make_data(steps: int, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    n = (steps + 16) * num_workers * BATCH
    x = torch.randn(n, FEATURES, generator=generator) * 3 + 1
    return x, torch.randint(0, CLASSES, (n,), generator=generator)


def worker_batch(
    x: torch.Tensor, y: torch.Tensor, step: int, worker: int, num_workers: int
) -> tuple[torch.Tensor, torch.Tensor]:
    start = (step * num_workers + worker) * BATCH
    return x[start : start + BATCH], y[start : start + BATCH]


def _wait_for_the_other_workers(out: str, num_workers: int, deadline_s: float = 120.0) -> None:
    """In async mode another worker may still push a step (and its buffers) after the chief
    has left its loop, and the final checkpoint, written once every worker is done, holds
    it: the chief pulls the shared state only once every other worker has written its
    result file (written after its last push was applied)."""
    deadline = time.monotonic() + deadline_s
    others = [Path(f"{out}.{index}.json") for index in range(1, num_workers)]
    while not all(path.exists() for path in others):
        if time.monotonic() > deadline:
            raise SystemExit(f"the other workers wrote no result within {deadline_s:.0f} s")
        time.sleep(0.05)


def _state(model: nn.Module) -> dict[str, list]:
    return {k: v.detach().tolist() for k, v in model.state_dict().items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode")
    parser.add_argument("steps", type=int)
    parser.add_argument("checkpoint_dir")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tfl.resolve_task(argv=[])
    server = tfl.Server(task.cluster, task.job, task.index)
    model = make_model()
    x, y = make_data(args.steps, task.num_workers)
    with tfl.TrainingSession(
        server, model, optimizer=tfl.optim.SGD(lr=0.1), mode=args.mode,
        hooks=[tfl.StopAtStep(last_step=args.steps)], checkpoint_dir=args.checkpoint_dir,
        log_placement=True,
    ) as sess:  # fmt: skip
        while not sess.should_stop():
            xb, yb = worker_batch(x, y, sess.global_step, task.index, task.num_workers)
            sess.step(lambda xb=xb, yb=yb: F.cross_entropy(sess.model(xb), yb))
        if sess.is_chief:
            if args.mode == "async":
                _wait_for_the_other_workers(args.out, task.num_workers)
            sess.pull()
        result = {"global_step": sess.global_step, "trained": _state(model)}
        model.eval()
        with torch.no_grad():
            sess.model(x[:BATCH])
        result["after_eval_forward"] = _state(model)
        result["scratch"] = model.scratch.item()
        with open(f"{args.out}.{task.index}.json", "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
