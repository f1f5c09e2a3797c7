"""k-fold cross-validation over the workers: one fold per trial, the mean and spread of the
validation metric, and a check that every sample was validated exactly once.

The folds are a pure function of ``(num_samples, k, seed)`` (:func:`fold_indices`): a seeded
permutation cut into k nearly equal parts, so fold ``i`` is the same on any worker, in any
order, after any restart. :func:`run_cross_validation` runs fold ``i`` as trial ``i`` of a
sweep (``search: list``), ``slots`` folds at once; each fold's program trains on
:func:`fold_indices`'s training part, evaluates on its validation part, keeps the validation
indices it actually used (:func:`keep_validation_indices`) and returns its metric. The result
checks those indices: together they must cover every sample exactly once, else it fails
naming the samples missing or repeated.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tensorfleet.errors import TensorfleetError
from tensorfleet.patterns.search_space import SweepConfigError
from tensorfleet.patterns.sweep import run_sweep
from tensorfleet.patterns.sweep_config import SweepConfig
from tensorfleet.patterns.sweep_report import PlainProgress
from tensorfleet.patterns.trial import Trial, load_trial_tensors

VALIDATION_INDICES = "validation_indices"


def fold_indices(
    num_samples: int, k: int, fold: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(training indices, validation indices) of ``fold`` (0-based) among ``k`` folds."""
    if not 2 <= k <= num_samples:
        raise SweepConfigError(f"k must be in 2..num_samples ({num_samples}), got {k}")
    if not 0 <= fold < k:
        raise SweepConfigError(f"fold must be in 0..{k - 1}, got {fold}")
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
    parts = torch.tensor_split(order, k)
    validation = parts[fold]
    training = torch.cat([p for i, p in enumerate(parts) if i != fold])
    return training, validation


def keep_validation_indices(trial: Trial, indices: torch.Tensor) -> None:
    """Record which samples this fold validated on (checked by the cross-validation)."""
    trial.save_tensors(VALIDATION_INDICES, {"indices": indices.long()})


@dataclass
class CrossValidationResult:
    """The validation metric of each fold, its mean and spread (sample standard deviation)."""

    metric: str
    scores: list[float]
    mean: float
    std: float
    folds: list[dict[str, Any]]
    directory: Path


def run_cross_validation(
    entry: str,
    k: int,
    num_samples: int,
    directory: str | os.PathLike[str],
    *,
    metric: str = "accuracy",
    direction: str = "maximize",
    seed: int = 0,
    params: Mapping[str, Any] | None = None,
    slots: int = 2,
    workers_per_trial: int = 1,
    pythonpath: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    progress: PlainProgress | None = None,
    live: bool | None = None,
) -> CrossValidationResult:
    """Run the ``k`` folds of ``entry`` (``module:function``; its trial gets ``fold``, ``k``,
    ``seed``, ``num_samples`` and ``params`` in ``trial.params``), ``slots`` at once."""
    if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= num_samples:
        raise SweepConfigError(f"k must be an integer in 2..num_samples ({num_samples}), got {k!r}")
    shared = dict(params or {})
    clash = sorted(set(shared) & {"fold", "k", "seed", "num_samples"})
    if clash:
        raise SweepConfigError(f"params may not set {clash}: the cross-validation sets them")
    config = SweepConfig(
        entry=entry,
        space={},
        configurations=[
            {"fold": i, "k": k, "seed": seed, "num_samples": num_samples, **shared}
            for i in range(k)
        ],
        search="list",
        metric=metric,
        direction=direction,
        slots=slots,
        workers_per_trial=workers_per_trial,
        pythonpath=list(pythonpath),
        env=dict(env or {}),
        name="cross-validation",
    )
    directory = Path(directory)
    sweep = run_sweep(config, directory, progress=progress, live=live)
    failed = [r for r in sweep.records if r.state != "complete" or r.value is None]
    if failed:
        raise TensorfleetError(
            "cross-validation needs every fold; failed: "
            + "; ".join(f"fold {r.number}: {r.error}" for r in failed)
            + f" (see {directory}/trials/). A fold that failed stays recorded as failed: "
            "to rerun it, delete its directory ("
            + ", ".join(f"{directory}/trials/{r.number:04d}" for r in failed)
            + ") and run it again (the folds that finished are kept)"
        )
    counts = torch.zeros(num_samples, dtype=torch.long)
    for record in sweep.records:
        kept = load_trial_tensors(directory / "trials" / f"{record.number:04d}", VALIDATION_INDICES)
        indices = kept["indices"]
        if indices.numel() and (indices.min() < 0 or indices.max() >= num_samples):
            raise TensorfleetError(
                f"fold {record.number} validated on indices outside 0..{num_samples - 1}"
            )
        counts += torch.bincount(indices, minlength=num_samples)
    missing = (counts == 0).nonzero().flatten().tolist()
    repeated = (counts > 1).nonzero().flatten().tolist()
    if missing or repeated:
        raise TensorfleetError(
            f"the folds must validate every sample exactly once: {len(missing)} never validated "
            f"(e.g. {missing[:5]}), {len(repeated)} validated more than once (e.g. {repeated[:5]}); "
            "validate on fold_indices(...)[1] of your fold"
        )
    scores = [float(r.value) for r in sorted(sweep.records, key=lambda r: r.number)]
    std = statistics.stdev(scores) if len(scores) > 1 else math.nan
    folds = [{"fold": r.number, metric: r.value, "seconds": r.seconds} for r in sweep.records]
    result = CrossValidationResult(metric, scores, statistics.fmean(scores), std, folds, directory)
    (directory / "cross_validation.json").write_text(
        json.dumps(
            {"metric": metric, "mean": result.mean, "std": result.std, "folds": folds}, indent=2
        )
        + "\n"
    )
    return result
