"""k-fold cross-validation: one fold per trial, the mean and spread of the validation
accuracy, and a check that every sample was validated exactly once.

Fold ``i`` trains on the other folds and validates on its own part of
``fold_indices(num_samples, k, i, seed)`` (a seeded permutation cut into k parts: the same on
any machine, after any restart); it keeps the validation indices it used
(``keep_validation_indices``), which ``run_cross_validation`` checks. Folds run ``--slots``
at once, each in a process of its own; running the same command again reruns only the folds
that did not finish::

    python examples/cross_validation_folds.py --k 5 --slots 2 --dir runs/cv

``params`` (here the learning rate and the steps) reach every fold in ``trial.params`` next
to ``fold``, ``k``, ``seed`` and ``num_samples``. The data is synthetic, so the example runs
anywhere.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.patterns.cross_validation import (
    fold_indices,
    keep_validation_indices,
    run_cross_validation,
)
from tensorfleet.patterns.trial import Trial

CLASSES, FEATURES = 3, 10


def dataset(n: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Three overlapping Gaussian classes (the same samples in every fold)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 1.2
    labels = torch.arange(n) % CLASSES
    return centers[labels] + torch.randn(n, FEATURES, generator=g) * 1.5, labels


def fold(trial: Trial) -> float:
    """One fold (``entry: cross_validation_folds:fold``): returns its validation accuracy."""
    torch.set_num_threads(1)  # folds share the machine's cores
    p = trial.params
    x, y = dataset(p["num_samples"])
    training, validation = fold_indices(p["num_samples"], p["k"], p["fold"], p["seed"])
    torch.manual_seed(p["fold"])
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))
    with tfl.TrainingSession(
        None, model, optimizer=tfl.optim.Adam(lr=p["lr"]), hooks=[tfl.StopAtStep(p["steps"])]
    ) as sess:
        while not sess.should_stop():
            sess.step(lambda: F.cross_entropy(model(x[training]), y[training]))
    keep_validation_indices(trial, validation)  # kept as validation_indices.safetensors
    with torch.no_grad():
        return float((model(x[validation]).argmax(1) == y[validation]).float().mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=5, help="folds")
    parser.add_argument("--samples", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=200, help="training steps per fold")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0, help="the folds' permutation")
    parser.add_argument("--slots", type=int, default=2, help="folds trained at once")
    parser.add_argument("--dir", default="runs/cv", help="the cross-validation's directory")
    args = parser.parse_args(argv)
    result = run_cross_validation(
        "cross_validation_folds:fold",
        args.k,
        args.samples,
        args.dir,
        metric="accuracy",
        direction="maximize",
        seed=args.seed,
        params={"lr": args.lr, "steps": args.steps},
        slots=args.slots,
        pythonpath=[str(Path(__file__).resolve().parent)],  # where the entry's module is
        live=False,
    )
    for number, score in enumerate(result.scores):
        print(f"fold {number}: accuracy {score:.3f}")
    print(
        f"{args.k}-fold accuracy {result.mean:.3f} +- {result.std:.3f} (sample std); every "
        f"sample validated once; {Path(args.dir) / 'cross_validation.json'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
