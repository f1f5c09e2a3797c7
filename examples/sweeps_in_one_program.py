"""Two sweeps in one program, their executors forked from one preloaded interpreter.

A coarse random search of the learning rate, then a finer grid around the best one found:
two calls of ``run_sweep``. ``preload()`` first starts an interpreter that imports torch and
tensorfleet once, in the background, while the program prepares its data; each sweep then
forks its executor from it instead of starting an interpreter that imports torch again::

    python examples/sweeps_in_one_program.py --dir runs/two-sweeps
    python examples/sweeps_in_one_program.py --dir runs/two-sweeps-cold --no-preload

The trial (``entry: sweeps_in_one_program:train``) is this file's ``train``: the executor
imports this module, so everything the program itself does sits under ``main``. The data is
synthetic (a noisy linear map), so the example runs anywhere.
"""

from __future__ import annotations

import argparse
import io
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tensorfleet.patterns.preloaded_interpreter import preload, release_preloaded
from tensorfleet.patterns.sweep import run_sweep
from tensorfleet.patterns.sweep_config import SweepConfig
from tensorfleet.patterns.sweep_report import PlainProgress
from tensorfleet.patterns.trial import Trial

HERE = Path(__file__).resolve().parent


def train(trial: Trial) -> float:
    """One trial: a linear model fitted by SGD at ``lr``; returns its final loss."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(512, 1, generator=g)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=trial.params["lr"])
    for step in range(int(trial.params["steps"])):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            trial.report(step, loss=loss.item())
    return loss.item() if math.isfinite(loss.item()) else 1e9


def sweep(directory: Path, space: dict, search: str, trials: int | None, steps: int) -> tuple:
    config = SweepConfig(
        entry="sweeps_in_one_program:train",
        space={**space, "steps": [steps]},
        search=search,
        trials=trials,
        metric="loss",
        pythonpath=[str(HERE)],
    )
    log = io.StringIO()
    started = time.monotonic()
    result = run_sweep(config, directory, progress=PlainProgress("loss", log))
    seconds = time.monotonic() - started
    forked = "forked from the preloaded interpreter" in log.getvalue()
    best = min(
        (r for r in result.records if r.state == "complete"), key=lambda r: r.value or math.inf
    )
    return best, seconds, forked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="runs/two-sweeps")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--trials", type=int, default=6, help="trials of the coarse search")
    parser.add_argument("--no-preload", action="store_true", help="each sweep starts its executor")
    args = parser.parse_args(argv)
    if not args.no_preload:
        preload()  # returns at once: the interpreter imports torch while we go on
    directory = Path(args.dir)
    coarse, seconds, forked = sweep(
        directory / "coarse",
        {"lr": {"type": "loguniform", "low": 1e-3, "high": 0.5}},
        "random",
        args.trials,
        args.steps,
    )
    print(
        f"coarse search: best lr {coarse.params['lr']:.4g}, loss {coarse.value:.4g} "
        f"({seconds:.1f} s; executor forked from the preloaded interpreter: {forked})"
    )
    lr = coarse.params["lr"]
    fine, seconds, forked = sweep(
        directory / "fine",
        {"lr": [round(lr * f, 6) for f in (0.5, 0.75, 1.0, 1.5, 2.0)]},
        "grid",
        None,
        args.steps,
    )
    print(
        f"fine grid: best lr {fine.params['lr']:.4g}, loss {fine.value:.4g} "
        f"({seconds:.1f} s; executor forked from the preloaded interpreter: {forked})"
    )
    release_preloaded()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
