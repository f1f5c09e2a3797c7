"""An ensemble: several small classifiers trained side by side, their averaged prediction
evaluated next to each member's.

Each member is a trial of a sweep (``run_ensemble``): it trains its own model (its own seed
for the initialization and a bootstrap sample of the training set) and keeps its class
probabilities on the test set with ``keep_predictions``; the ensemble averages them (soft
voting) and writes ``ensemble.json``. Members run ``--slots`` at once, each in a process of
its own; a member that fails is recorded without stopping the others, and running the same
command again resumes an interrupted ensemble::

    python examples/ensemble_members.py --members 4 --slots 2 --dir runs/ensemble

The data is synthetic (three overlapping Gaussian classes), so the example runs anywhere.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.patterns.ensemble import keep_predictions, run_ensemble
from tensorfleet.patterns.trial import Trial

CLASSES, FEATURES, SAMPLES = 3, 10, 1200


def dataset(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Three overlapping Gaussian classes: the same samples for every member."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 1.2
    labels = torch.arange(SAMPLES) % CLASSES
    return centers[labels] + torch.randn(SAMPLES, FEATURES, generator=g) * 1.5, labels


def member(trial: Trial) -> float:
    """One member (``entry: ensemble_members:member``): returns its test accuracy."""
    torch.set_num_threads(1)  # members share the machine's cores
    seed, steps = trial.params["seed"], trial.params["steps"]
    x, y = dataset()
    half = SAMPLES // 2
    train_x, train_y, test_x, test_y = x[:half], y[:half], x[half:], y[half:]
    pick = torch.randint(0, half, (half,), generator=torch.Generator().manual_seed(100 + seed))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))
    with tfl.TrainingSession(
        None, model, optimizer=tfl.optim.Adam(lr=0.02), hooks=[tfl.StopAtStep(steps)]
    ) as sess:
        while not sess.should_stop():
            sess.step(lambda: F.cross_entropy(model(train_x[pick]), train_y[pick]))
    with torch.no_grad():
        probs = F.softmax(model(test_x), dim=1)
    return keep_predictions(trial, probs, test_y)  # kept as predictions.safetensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=4, help="how many models (seeds 0..)")
    parser.add_argument("--steps", type=int, default=200, help="training steps per member")
    parser.add_argument("--slots", type=int, default=2, help="members trained at once")
    parser.add_argument("--dir", default="runs/ensemble", help="the ensemble's directory")
    args = parser.parse_args(argv)
    result = run_ensemble(
        "ensemble_members:member",
        [{"seed": s, "steps": args.steps} for s in range(args.members)],
        args.dir,
        slots=args.slots,
        pythonpath=[str(Path(__file__).resolve().parent)],  # where the entry's module is
        live=False,
    )
    for m in result.members:
        accuracy = "-" if m["accuracy"] is None else f"{m['accuracy']:.3f}"
        print(
            f"member {m['member']} (seed {m['params']['seed']}): {m['state']}, accuracy {accuracy}"
        )
    print(
        f"ensemble of {len(result.members) - len(result.failed)}: accuracy "
        f"{result.ensemble_accuracy:.3f} (best member {result.best_member_accuracy:.3f}); "
        f"{Path(args.dir) / 'ensemble.json'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
