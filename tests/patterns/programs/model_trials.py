"""Member and fold programs for the ensemble and cross-validation tests: a small MLP on a
synthetic 3-class problem, trained in one process with a TrainingSession."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.patterns.cross_validation import fold_indices, keep_validation_indices
from tensorfleet.patterns.ensemble import keep_predictions
from tensorfleet.patterns.trial import Trial

CLASSES, FEATURES = 3, 10


def blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three overlapping Gaussian classes (the same for every caller with the same seed)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 1.2
    labels = torch.arange(n) % CLASSES
    x = centers[labels] + torch.randn(n, FEATURES, generator=g) * 1.5
    return x, labels


def train(x: torch.Tensor, y: torch.Tensor, seed: int, steps: int = 150) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))
    with tfl.TrainingSession(
        None, model, optimizer=tfl.optim.Adam(lr=0.02), hooks=[tfl.StopAtStep(steps)]
    ) as sess:
        while not sess.should_stop():
            sess.step(lambda: F.cross_entropy(model(x), y))
    return model


def member(trial: Trial) -> float:
    """One ensemble member: its own seed for the initialization and a bootstrap sample."""
    torch.set_num_threads(1)
    seed = trial.params["seed"]
    x, y = blobs(600, seed=7)
    train_x, train_y, test_x, test_y = x[:300], y[:300], x[300:], y[300:]
    pick = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(100 + seed))
    model = train(train_x[pick], train_y[pick], seed)
    with torch.no_grad():
        probs = F.softmax(model(test_x), dim=1)
    return keep_predictions(trial, probs, test_y)


def fold(trial: Trial) -> float:
    """One fold: train on the other folds, validate on this one."""
    torch.set_num_threads(1)
    p = trial.params
    x, y = blobs(p["num_samples"], seed=7)
    training, validation = fold_indices(p["num_samples"], p["k"], p["fold"], p["seed"])
    model = train(x[training], y[training], seed=p["fold"])
    keep_validation_indices(trial, validation)
    with torch.no_grad():
        return float((model(x[validation]).argmax(1) == y[validation]).float().mean())


def wrong_fold(trial: Trial) -> float:
    """A fold program with a bug: every fold validates on the first third."""
    n = trial.params["num_samples"]
    keep_validation_indices(trial, torch.arange(n // 3))
    return 0.5


def fold_failing_once(trial: Trial) -> float:
    """``fold``, except that fold 1 fails while the file ``FOLD_MAY_PASS`` names is absent."""
    if trial.params["fold"] == 1 and not os.path.exists(os.environ["FOLD_MAY_PASS"]):
        raise RuntimeError("fold one broke")
    return fold(trial)
