"""A worker for the overlap test: an MLP trained on Gaussian blobs in async mode with its
gradients pushed in small buckets during the backward pass and the last reply prefetched,
checkpoints every 20 global steps, and a timeline.

Usage: overlap_worker.py RESULT_JSON LAST_STEP CHECKPOINT_DIR TIMELINE

The chief writes ``{"accuracy", "global_step", "steps", "dropped"}`` of the final model (after
``sess.pull()``) to RESULT_JSON; every worker writes its timeline (TIMELINE.<task>.json).
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.datasets.batches import BatchStream

FEATURES, CLASSES, SAMPLES = 16, 4, 2048


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Four Gaussian blobs: a task an MLP learns to > 0.9 accuracy in ~100 steps."""
    generator = torch.Generator().manual_seed(7)
    centers = 2.0 * torch.randn(CLASSES, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    points = centers[labels] + torch.randn(SAMPLES, FEATURES, generator=generator)
    return points, labels


def main() -> int:
    result_path, last_step, checkpoint_dir, timeline = sys.argv[1:5]
    torch.set_num_threads(1)
    task = tfl.resolve_task()
    server = tfl.Server(task.cluster, task.job, task.index)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES)
    )
    x, y = dataset()
    data = BatchStream(x, y, 32, shard_index=task.index, num_shards=task.num_workers, seed=1)
    dropped = 0
    with tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.Adam(lr=0.01),
        hooks=[tfl.StopAtStep(last_step=int(last_step))],
        overlap=tfl.Overlap(bucket_bytes=512, prefetch=True),
        checkpoint_dir=checkpoint_dir,
        save_checkpoint_steps=20,
        data=data,
        timeline=timeline,
        progress_secs=None,
    ) as sess:
        steps = 0
        while not sess.should_stop():
            images, labels = next(data)
            result = sess.step(
                lambda images=images, labels=labels: nn.functional.cross_entropy(
                    model(images), labels
                )
            )
            steps += 1
            dropped += result.dropped
        if sess.is_chief:
            final = sess.pull()
            with torch.no_grad():
                accuracy = (model(x).argmax(1) == y).float().mean().item()
            with open(result_path, "w") as f:
                json.dump(
                    {
                        "accuracy": accuracy,
                        "global_step": final,
                        "steps": steps,
                        "dropped": dropped,
                    },
                    f,
                )
    print(f"done worker={task.index} steps={steps}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
