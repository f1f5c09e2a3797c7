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

or several strengths at once on one cluster's ps tasks, each a model in its own namespace
(``model_name="ridge-0.01"``) trained by its own group of workers (``--ridges``: the workers
are split into as many consecutive groups as strengths)::

    tensorfleet launch --ps 1 --workers 4 -- python examples/ridge_regression.py --ridges 0.01,1
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
    parser.add_argument(
        "--ridges",
        default=None,
        help="several strengths (comma-separated), each a model of its own on the same ps tasks",
    )
    parser.add_argument("--steps", type=int, default=300, help="gradient steps")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    parser.add_argument(
        "--checkpoint-dir", default=None, help="(named models: one subdirectory each)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tfl.resolve_task(allow_none=True, argv=[])
    server = tfl.Server(task.cluster, task.job, task.index) if task else None
    if args.ridges is None:
        return train(server, args.ridge, args)
    ridges = [float(r) for r in args.ridges.split(",")]
    if server is None:  # one process: one strength after the other
        return max(train(None, ridge, args, f"ridge-{ridge:g}") for ridge in ridges)
    workers = [str(t) for t in server.worker_tasks]
    if len(workers) % len(ridges):
        raise SystemExit(f"{len(workers)} workers do not split into {len(ridges)} equal groups")
    size = len(workers) // len(ridges)
    group = workers.index(str(server.task)) // size
    ridge = ridges[group]
    model_workers = workers[group * size : (group + 1) * size]
    return train(server, ridge, args, f"ridge-{ridge:g}", model_workers)


def train(
    server: tfl.Server | None,
    ridge: float,
    args: argparse.Namespace,
    model_name: str = "",
    model_workers: list[str] | None = None,
) -> int:
    """Train the strength ``ridge`` (in the namespace ``model_name``) and, on the chief,
    print its gap to the closed form."""
    args.ridge = ridge
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
        model_name=model_name,
        model_workers=model_workers,
        checkpoint_dir=args.checkpoint_dir,
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
                    {
                        "model": model_name,
                        "ridge": args.ridge,
                        "steps": sess.global_step,
                        "loss": final_loss,
                        "gap": gap,
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
