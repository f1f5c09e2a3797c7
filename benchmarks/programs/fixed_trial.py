"""A sweep trial of fixed work: a small MLP trained for a fixed number of steps (one
thread), so that every trial costs the same and only the scheduling differs.

A module, not a script: ``benchmarks/patterns.py``'s sweep imports it (``entry="fixed_trial:train"``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorfleet.patterns.trial import Trial


def train(trial: Trial) -> float:
    torch.set_num_threads(1)
    torch.manual_seed(trial.params["seed"])
    x, y = torch.randn(512, 32), torch.randint(0, 4, (512,))
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    opt = torch.optim.SGD(model.parameters(), lr=trial.params["lr"])
    for step in range(trial.params["steps"]):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            trial.report(step, loss=float(loss))
    return float(loss)


def search_train(trial: Trial) -> float:
    """A search trial: the same MLP, its width and learning rate from the search, ``steps``
    steps (so about the same time whatever the search picks)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(512, 32), torch.randint(0, 4, (512,))
    width = int(trial.params["width"])
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 4))
    opt = torch.optim.SGD(model.parameters(), lr=trial.params["lr"])
    steps = int(trial.params["steps"])
    for step in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            trial.report(step, loss=loss.item())
    return loss.item()
