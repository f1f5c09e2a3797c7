"""A worker that reads a ``DataLoader`` with two worker processes, in the loop of a DDP
script: it takes the next batch, then asks ``should_stop()``, then steps, so a SIGTERM to the
whole task (which ends the loader's workers) is found by the loader first.

    loader_worker.py CHECKPOINT_DIR MODE STEPS [never-ask]

``never-ask``: the loop never calls ``should_stop()`` (it ends at STEPS by the global step),
as many ported scripts do.

It prints ``progress worker=I global_step=S`` after each step and ``started worker=I
global_step=S`` once its session has started."""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tensorfleet as tfl


def main() -> int:
    checkpoint_dir, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    asks = sys.argv[4:] != ["never-ask"]
    torch.set_num_threads(1)
    task = tfl.resolve_task()
    server = tfl.Server(task.cluster, task.job, task.index)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = TensorDataset(torch.randn(100_000, 4), torch.randn(100_000, 1))
    loader = DataLoader(data, batch_size=8, num_workers=2)
    with tfl.TrainingSession(
        server, model, optimizer=tfl.optim.SGD(lr=0.01), mode=mode, checkpoint_dir=checkpoint_dir,
        hooks=[tfl.StopAtStep(last_step=steps)], progress_secs=None,
    ) as sess:  # fmt: skip
        print(f"started worker={task.index} global_step={sess.global_step}", flush=True)
        for x, y in loader:
            if sess.should_stop() if asks else sess.global_step >= steps:
                break
            sess.step(lambda x=x, y=y: nn.functional.mse_loss(sess.model(x), y))
            print(f"progress worker={task.index} global_step={sess.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
