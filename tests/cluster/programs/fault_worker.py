"""A worker for fault-injection tests: a small classifier with BatchNorm trained through the
parameter servers with checkpoints, a tracked data position and a little sleep per step, so that a
test has time to kill tasks while it trains.

Usage: fault_worker.py CHECKPOINT_DIR RESULT_JSON LAST_STEP MODE [REPLICAS_TO_AGGREGATE]
(CHECKPOINT_DIR ``-``: no checkpoints)

It prints ``progress worker=I global_step=S`` for every 10th global step it makes and
``start worker=I global_step=S`` once its session has started (the step it joined at). The
chief writes ``{"accuracy", "global_step"}`` of the final model to RESULT_JSON.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.datasets.batches import BatchStream

FEATURES, CLASSES, SAMPLES = 16, 4, 2048
STEP_SLEEP_S = 0.02


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Four Gaussian blobs: a task a linear model learns to > 0.9 accuracy in ~100 steps."""
    generator = torch.Generator().manual_seed(7)
    centers = 2.0 * torch.randn(CLASSES, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    points = centers[labels] + torch.randn(SAMPLES, FEATURES, generator=generator)
    return points, labels


def main() -> int:
    checkpoint_dir, result_path, last_step, mode = sys.argv[1:5]
    replicas = int(sys.argv[5]) if len(sys.argv) > 5 else None
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("tensorfleet.session").setLevel(logging.INFO)
    torch.set_num_threads(1)
    task = tfl.resolve_task()
    server = tfl.Server(task.cluster, task.job, task.index)
    torch.manual_seed(0)
    # BatchNorm: the faults hit a model with persistent buffers (held on the ps beside the
    # variables), as the users' models have them.
    model = nn.Sequential(
        nn.Linear(FEATURES, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, CLASSES)
    )
    x, y = dataset()
    data = BatchStream(x, y, 32, shard_index=task.index, num_shards=task.num_workers, seed=1)
    with tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.Adam(lr=0.01),
        mode=mode,
        replicas_to_aggregate=replicas,
        hooks=[tfl.StopAtStep(last_step=int(last_step))],
        checkpoint_dir=None if checkpoint_dir == "-" else checkpoint_dir,
        save_checkpoint_steps=None if checkpoint_dir == "-" else 20,
        data=data,
        timeouts=tfl.ClientTimeouts(ps_silence_s=5.0, recover_s=90.0),
    ) as sess:
        print(
            f"start worker={task.index} global_step={sess.global_step} "
            f"data={json.dumps(data.state_dict(), sort_keys=True)}",
            flush=True,
        )
        while not sess.should_stop():
            images, labels = next(data)
            result = sess.step(
                lambda images=images, labels=labels: nn.functional.cross_entropy(
                    model(images), labels
                )
            )
            if result.made_step and result.global_step % 10 == 0:
                print(f"progress worker={task.index} global_step={result.global_step}", flush=True)
            time.sleep(STEP_SLEEP_S)
        if sess.is_chief:
            sess.pull()
            model.eval()  # BatchNorm with the running statistics the ps holds
            with torch.no_grad():
                accuracy = (model(x).argmax(1) == y).float().mean().item()
            with open(result_path, "w") as f:
                json.dump({"accuracy": accuracy, "global_step": sess.global_step}, f)
    print(f"done worker={task.index}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
