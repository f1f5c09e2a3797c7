"""Ensembles: K models (by seed or configuration) trained in parallel, their averaged
prediction evaluated next to each member's.

:func:`run_ensemble` runs the members as the trials of a sweep (``search: list``, one
configuration per member), so members train side by side in the slots (one process each, or
a local cluster each with ``workers_per_trial``), a member that fails is recorded without
stopping the others, and an interrupted ensemble resumes. Each member ends by keeping its
predictions on the evaluation set::

    trial.save_tensors("predictions", {"probs": probs, "labels": labels})  # [N, C] and [N]

(:func:`keep_predictions` does that). The ensemble then averages the members' class
probabilities (soft voting: a member's confidence counts, unlike a majority vote), checks
that every member predicted the same evaluation set (same labels), and reports the accuracy
of the average next to each member's in ``ensemble.json``.

Why through files and not the wire: predictions are tensors a member computes once at its
end; safetensors in its trial directory are read without running code, survive a killed
ensemble, and are there to inspect afterwards.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.patterns.search_space import SweepConfigError
from tensorfleet.patterns.sweep import run_sweep
from tensorfleet.patterns.sweep_config import SweepConfig
from tensorfleet.patterns.sweep_report import PlainProgress
from tensorfleet.patterns.trial import Trial, load_trial_tensors

PREDICTIONS = "predictions"


def keep_predictions(trial: Trial, probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Keep a member's class probabilities ``[N, C]`` and the true ``labels`` ``[N]`` for the
    ensemble; return the member's accuracy (report it, or return it from the entry point)."""
    if probs.ndim != 2 or labels.ndim != 1 or probs.shape[0] != labels.shape[0]:
        raise ConfigError(
            f"probs must be [N, C] and labels [N]; got {list(probs.shape)} and {list(labels.shape)}"
        )
    trial.save_tensors(PREDICTIONS, {"probs": probs.float(), "labels": labels.long()})
    return accuracy(probs, labels)


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of rows whose most probable class is the label."""
    return float((probs.argmax(dim=1) == labels).float().mean())


@dataclass
class EnsembleResult:
    """The ensemble's accuracy next to each member's."""

    ensemble_accuracy: float
    members: list[dict[str, Any]]
    """One entry per member: ``member``, ``params``, ``state``, ``accuracy``, ``error``."""
    failed: list[int] = field(default_factory=list)
    directory: Path | None = None

    @property
    def best_member_accuracy(self) -> float:
        return max(
            (m["accuracy"] for m in self.members if m["accuracy"] is not None), default=math.nan
        )


def run_ensemble(
    entry: str,
    members: Sequence[Mapping[str, Any]],
    directory: str | os.PathLike[str],
    *,
    slots: int = 2,
    workers_per_trial: int = 1,
    pythonpath: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    progress: PlainProgress | None = None,
    live: bool | None = None,
) -> EnsembleResult:
    """Train one model per configuration of ``members`` (e.g. ``[{"seed": 0}, {"seed": 1},
    {"seed": 2}]``) with the entry point ``module:function``, ``slots`` at once; evaluate
    their averaged prediction. The entry point must call :func:`keep_predictions`."""
    if len(members) < 2:
        raise SweepConfigError(f"an ensemble needs at least 2 members, got {len(members)}")
    config = SweepConfig(
        entry=entry,
        space={},
        configurations=[dict(m) for m in members],
        search="list",
        metric="accuracy",
        direction="maximize",
        slots=slots,
        workers_per_trial=workers_per_trial,
        pythonpath=list(pythonpath),
        env=dict(env or {}),
        name="ensemble",
    )
    directory = Path(directory)
    sweep = run_sweep(config, directory, progress=progress, live=live)
    rows, probs, labels, failed = [], [], None, []
    for record in sweep.records:
        row = {
            "member": record.number,
            "params": record.params,
            "state": record.state,
            "accuracy": None,
            "error": record.error,
        }
        if record.state == "complete":
            kept = load_trial_tensors(directory / "trials" / f"{record.number:04d}", PREDICTIONS)
            if labels is None:
                labels = kept["labels"]
            elif not torch.equal(labels, kept["labels"]):
                raise TensorfleetError(
                    f"member {record.number} predicted another evaluation set (its labels differ "
                    "from member 0's): every member must predict the same samples in the same order"
                )
            if probs and kept["probs"].shape != probs[0].shape:
                raise TensorfleetError(
                    f"member {record.number}'s predictions have shape {list(kept['probs'].shape)}, "
                    f"the others {list(probs[0].shape)}"
                )
            probs.append(kept["probs"])
            row["accuracy"] = accuracy(kept["probs"], kept["labels"])
        else:
            failed.append(record.number)
        rows.append(row)
    if not probs or labels is None:
        errors = "; ".join(f"member {r['member']}: {r['error']}" for r in rows if r["error"])
        raise TensorfleetError(
            f"no member of the ensemble completed ({errors or 'no error recorded'}; see "
            f"{directory}/results.csv). A member that failed stays recorded as failed: to run it "
            f"again, delete its directory ({', '.join(f'{directory}/trials/{n:04d}' for n in failed)})"
            " or give another directory"
        )
    average = torch.stack(probs).mean(dim=0)
    result = EnsembleResult(accuracy(average, labels), rows, failed, directory)
    (directory / "ensemble.json").write_text(
        json.dumps({"ensemble_accuracy": result.ensemble_accuracy, "members": rows}, indent=2)
        + "\n"
    )
    return result
