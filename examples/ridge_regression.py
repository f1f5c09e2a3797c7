"""Ridge regression: gradient descent on the cluster against the closed-form solution.

The classic first example of distributed training: the loss

    L(W) = |X W^T - Y|^2 / n + ridge * |W|^2

has the closed-form minimizer W* = (X^T X / n + ridge I)^-1 X^T Y / n, so a training run can be
checked to the last digits. Every worker computes the full-batch gradient on the same data in
``sync`` mode, so the cluster does plain gradient descent; the chief compares the trained
weight with W* (computed in float64) and prints the largest difference (``gap``).

Run it alone (one process), on a local cluster, or as the trials of a sweep over ``--ridge``
(each trial a cluster of its own; the chief reports ``gap`` and ``loss`` to the sweep)::

    python examples/ridge_regression.py --ridge 0.1
    tensorfleet launch --ps 1 --workers 2 -- python examples/ridge_regression.py --ridge 0.1
    tensorfleet sweep examples/ridge_sweep.yaml --dir runs/ridge-sweep
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

import tensorfleet as tfl

SAMPLES, FEATURES, OUTPUTS = 256, 8, 4


def dataset(seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """The same deterministic regression data on every worker."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    w = torch.randn(OUTPUTS, FEATURES, generator=generator, dtype=torch.float64)
    y = x @ w.T + 0.1 * torch.randn(SAMPLES, OUTPUTS, generator=generator, dtype=torch.float64)
    return x.float(), y.float()


def closed_form(ridge: float) -> torch.Tensor:
    """W* (float64, OUTPUTS x FEATURES), the minimizer of the training loss."""
    x, y = (t.double() for t in dataset())
    n = x.shape[0]
    eye = torch.eye(FEATURES, dtype=torch.float64)
    return torch.linalg.solve(x.T @ x / n + ridge * eye, x.T @ y / n).T


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ridge", type=float, default=0.1, help="regularization strength")
    parser.add_argument("--steps", type=int, default=300, help="gradient steps")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tfl.resolve_task(allow_none=True, argv=[])
    server = tfl.Server(task.cluster, task.job, task.index) if task else None
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, OUTPUTS, bias=False)
    x, y = dataset()
    target = closed_form(args.ridge)
    trial = None
    if os.environ.get("TENSORFLEET_TRIAL_DIR"):  # started by a sweep: report to it
        from tensorfleet.patterns.trial import current_trial

        trial = current_trial()

    def loss() -> torch.Tensor:
        return ((model(x) - y) ** 2).sum() / SAMPLES + args.ridge * (model.weight**2).sum()

    with tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.SGD(lr=args.lr),
        mode="sync" if server is not None else "async",
        hooks=[tfl.StopAtStep(last_step=args.steps)],
    ) as sess:
        while not sess.should_stop():
            result = sess.step(loss)
            if sess.is_chief and trial is not None and sess.global_step % 50 == 0:
                gap = (model.weight.detach().double() - target).abs().max().item()
                trial.report(sess.global_step, gap=gap, loss=float(result.loss))
        if sess.is_chief:
            sess.pull()
            gap = (model.weight.detach().double() - target).abs().max().item()
            with torch.no_grad():
                final_loss = float(loss())
            if trial is not None:
                trial.report(sess.global_step, gap=gap, loss=final_loss)
            print(
                json.dumps(
                    {"ridge": args.ridge, "steps": sess.global_step, "loss": final_loss, "gap": gap}
                )
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
