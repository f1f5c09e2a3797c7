"""Population-based training of a noisy regression whose best learning rate falls over time.

Minibatch SGD on a linear regression with noisy labels and features of very different
scales: a large learning rate gets close fast but then jitters at a noise floor that grows
with the rate, a small one is precise but slow on the small-scale features. No single rate
is best for the whole run; the best schedule starts high and falls. Population-based
training finds such a schedule on the way: every round the worst member copies the best
(its weights and optimizer state, on the ps) and tries its learning rate halved or doubled.

Run it (4 members on one ps task in this process; the lineage is written to the directory)::

    python examples/pbt_schedule.py --dir runs/pbt-schedule
    python examples/pbt_schedule.py --dir runs/pbt-fixed --no-exploit   # the same, fixed rates
    tensorfleet pbt examples/pbt_schedule.yaml --dir runs/pbt-schedule  # from the config file

The score is the squared distance of the weights to the true ones (lower is better).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from tensorfleet.patterns.pbt import run_pbt
from tensorfleet.patterns.pbt_config import PopulationConfig

#: The members' initial learning rates (one each), searched by PBT.
LEARNING_RATES = [0.5, 0.15, 0.045, 0.0135]


class NoisyRegression:
    """``y = x w* + noise``; ``x``'s features scaled from 1 down to ``1 / condition``."""

    def __init__(
        self,
        seed: int = 0,
        features: int = 16,
        batch: int = 4,
        noise: float = 1.0,
        condition: float = 3.0,
    ) -> None:
        generator = torch.Generator().manual_seed(1000 + seed)
        self.seed, self.features, self.batch, self.noise = seed, features, batch, noise
        self.scales = torch.logspace(0, -torch.log10(torch.tensor(condition)).item(), features)
        self.true_w = torch.randn(features, generator=generator)

    def build_model(self, member: int) -> nn.Module:
        torch.manual_seed(self.seed * 100 + member)
        model = nn.Linear(self.features, 1, bias=False)
        nn.init.zeros_(model.weight)
        return model

    def loss(self, model: nn.Module, step: int, member: int) -> torch.Tensor:
        """The batch of the member's step ``step``: the same data for a step on any member."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 7919 + member)
        x = torch.randn(self.batch, self.features, generator=generator) * self.scales
        y = x @ self.true_w + self.noise * torch.randn(self.batch, generator=generator)
        return nn.functional.mse_loss(model(x).squeeze(-1), y)

    def evaluate(self, model: nn.Module) -> float:
        """The squared distance of the weights to ``w*`` (the excess risk's scale)."""
        return float(((model.weight.detach().squeeze(0) - self.true_w) ** 2).sum())


def make_problem(seed: int = 0, **options: float) -> NoisyRegression:
    """The factory a PBT config names (``problem: pbt_schedule.py:make_problem``)."""
    return NoisyRegression(seed, **options)  # type: ignore[arg-type]


def config(rounds: int = 12, steps_per_round: int = 25, seed: int = 0) -> PopulationConfig:
    """The population of this example: 4 members searching the learning rate of SGD."""
    return PopulationConfig(
        problem=f"{__file__}:make_problem",
        hyperparameters={"lr": {"values": LEARNING_RATES, "low": 1e-4, "high": 1.0}},
        members=4,
        rounds=rounds,
        steps_per_round=steps_per_round,
        rule="sgd",
        perturb=[0.5, 2.0],
        seed=seed,
        name="pbt-schedule",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="runs/pbt-schedule", help="the run directory")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps-per-round", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-exploit", action="store_true", help="fixed learning rates")
    args = parser.parse_args()
    torch.set_num_threads(1)
    population = config(args.rounds, args.steps_per_round, args.seed)
    population.exploit = not args.no_exploit
    result = run_pbt(population, args.dir, make_problem(args.seed))
    print(
        json.dumps(
            {
                "best_member": result.best_member,
                "best_score": result.best_score,
                "best_hyperparameters": result.best_hyperparameters,
                "exploits": len(result.lineage.exploits()),
                "lineage": str(result.directory / "lineage.png"),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
