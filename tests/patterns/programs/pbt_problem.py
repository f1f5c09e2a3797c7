"""A small PBT problem for the tests: a noisy linear regression (one SGD learning rate per
member), which kills its own process (SIGKILL, no cleanup) when member ``kill_member``
reaches step ``kill_at_step`` and the environment variable ``PBT_TEST_KILL`` is set."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn


class Problem:
    def __init__(self, seed: int, kill_member: int, kill_at_step: int) -> None:
        self.seed, self.kill_member, self.kill_at_step = seed, kill_member, kill_at_step
        self.true_w = torch.randn(6, generator=torch.Generator().manual_seed(seed))

    def build_model(self, member: int) -> nn.Module:
        model = nn.Linear(6, 1, bias=False)
        nn.init.zeros_(model.weight)
        return model

    def loss(self, model: nn.Module, step: int, member: int) -> torch.Tensor:
        if os.environ.get("PBT_TEST_KILL") and (member, step) == (
            self.kill_member,
            self.kill_at_step,
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 7919 + member)
        x = torch.randn(4, 6, generator=generator)
        y = x @ self.true_w + 0.5 * torch.randn(4, generator=generator)
        return nn.functional.mse_loss(model(x).squeeze(-1), y)

    def evaluate(self, model: nn.Module) -> float:
        return float(((model.weight.detach().squeeze(0) - self.true_w) ** 2).sum())


def make_problem(seed: int = 0, kill_member: int = 2, kill_at_step: int = -1) -> Problem:
    return Problem(seed, kill_member, kill_at_step)
