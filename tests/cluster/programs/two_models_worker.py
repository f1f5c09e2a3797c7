"""Two models trained at once on the same ps tasks, each in its own namespace: workers 0-1
train model ``narrow`` (hidden width 8), workers 2-3 model ``wide`` (hidden width 24), both
in sync mode with their own global step and checkpoints. Each model's chief writes its final
parameters to OUT_DIR/<model>.json.

    two_models_worker.py OUT_DIR CHECKPOINT_DIR STEPS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

FEATURES, CLASSES, BATCH = 6, 3, 8
#: model name -> (its workers, hidden width, learning rate, data seed)
MODELS = {"narrow": ((0, 1), 8, 0.1, 11), "wide": ((2, 3), 24, 0.05, 12)}


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(hidden)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, CLASSES))


def make_data(steps: int, seed: int, num_workers: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    n = (steps + 4) * num_workers * BATCH
    return torch.randn(n, FEATURES, generator=generator), torch.randint(
        0, CLASSES, (n,), generator=generator
    )


def model_of(worker: int) -> str:
    return next(name for name, (workers, *_) in MODELS.items() if worker in workers)


def main() -> int:
    out_dir, checkpoint_dir, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    task = tfl.resolve_task(argv=[])
    server = tfl.Server(task.cluster, task.job, task.index)
    name = model_of(task.index)
    workers, hidden, lr, seed = MODELS[name]
    rank = workers.index(task.index)
    model = make_model(hidden)
    x, y = make_data(steps, seed)
    with tfl.TrainingSession(
        server, model, optimizer=tfl.optim.SGD(lr=lr), mode="sync",
        model_name=name, model_workers=workers, log_placement=True,
        hooks=[tfl.StopAtStep(last_step=steps)],
        checkpoint_dir=checkpoint_dir, save_checkpoint_steps=5,
    ) as sess:  # fmt: skip
        while not sess.should_stop():
            start = (sess.global_step * len(workers) + rank) * BATCH
            xb, yb = x[start : start + BATCH], y[start : start + BATCH]
            sess.step(lambda xb=xb, yb=yb: F.cross_entropy(sess.model(xb), yb))
        if sess.is_chief:
            sess.pull()
            result = {
                "params": {k: v.detach().tolist() for k, v in model.state_dict().items()},
                "global_step": sess.global_step,
                "task": str(task.task_id),
            }
            (out_dir / f"{name}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
