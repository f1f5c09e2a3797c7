"""A worker that trains a ridge regression on the parameter servers and, as the chief,
writes the final weights to the JSON file given as its argument.

Every worker uses the whole (deterministic) dataset, so that asynchronous full-batch
gradient steps converge to the exact minimizer: the closed-form ridge solution.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import tensorfleet as tfl

SAMPLES, FEATURES, OUTPUTS, RIDGE = 256, 8, 4, 0.1


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """The same deterministic regression data on every worker (and in the tests)."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    w = torch.randn(OUTPUTS, FEATURES, generator=generator, dtype=torch.float64)
    y = x @ w.T + 0.1 * torch.randn(SAMPLES, OUTPUTS, generator=generator, dtype=torch.float64)
    return x.float(), y.float()


def closed_form() -> torch.Tensor:
    """The minimizer of the training loss on :func:`dataset` (float64, OUTPUTS x FEATURES):
    the weight that training must reach."""
    x, y = (t.double() for t in dataset())
    n = x.shape[0]
    # minimize  OUTPUTS * mean((x W^T - y)^2) + RIDGE * |W|^2  =  |xW^T - y|^2 / n + RIDGE |W|^2
    return torch.linalg.solve(
        x.T @ x / n + RIDGE * torch.eye(x.shape[1], dtype=torch.float64), x.T @ y / n
    ).T


def main() -> int:
    out_path, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    task = tfl.resolve_task()
    server = tfl.Server(task.cluster, task.job, task.index)
    torch.manual_seed(task.index)  # different local inits: the chief's must win
    model = nn.Linear(FEATURES, OUTPUTS, bias=False)
    x, y = dataset()
    with tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.SGD(lr=0.1),
        hooks=[tfl.StopAtStep(last_step=steps)],
        partition_threshold_bytes=64,  # the 4x8 weight is cut in two parts, one per shard
        log_placement=True,
    ) as sess:
        while not sess.should_stop():
            sess.step(
                lambda: ((model(x) - y) ** 2).mean() * OUTPUTS + RIDGE * (model.weight**2).sum()
            )
        if sess.is_chief:
            sess.pull()
            with open(out_path, "w") as f:
                json.dump(
                    {
                        "weight": model.weight.detach().double().tolist(),
                        "global_step": sess.global_step,
                    },
                    f,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
