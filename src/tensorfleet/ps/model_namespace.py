"""A model's namespace on the ps tasks: its name, the workers that train it, and what its
variables look like, as both sides of the wire check them.

Several independent trainings can share the ps tasks of one cluster, each in its own
namespace (``TrainingSession(..., model_name="trial-3", model_workers=[...])``); the ps keeps
one :class:`~tensorfleet.ps.service.ParameterService` per model
(:mod:`tensorfleet.ps.model_router`). The default model ``""`` is a cluster's only model when
no name is given: it is trained by every worker, exactly as without namespaces.

The rules of a namespace (:class:`ModelClaim`, sent with each ``hello``):

* **A name** is ``""`` (the default) or 1 to 64 characters of letters, digits, ``.``, ``_``
  and ``-`` not starting with a dot (it names the checkpoint subdirectory too).
* **Its workers are declared, not discovered.** Every worker of the model sends the same
  list of the model's worker tasks; the first of them in cluster order is the model's chief
  (it creates the variables, saves the checkpoints, declares the end). Declared rather than
  "whoever said hello": a sync step needs the number of workers before the others have
  said hello, and the end of one model's training must wait for its own workers only
  (never for another model's).
* **One claim per name.** The first hello of a model fixes its workers and the fingerprint
  of its variables (names, shapes, dtypes); a hello with other workers or another
  fingerprint is another training claiming the same name, and is refused with
  :class:`~tensorfleet.errors.RequestRefused` naming the model and both claims, before
  anything is created. A hello without a claim (an older or a test client) checks nothing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tensorfleet.errors import ConfigError, ProtocolError, RequestRefused

DEFAULT_MODEL = ""
"""The model of requests that name none: a cluster's only model, trained by every worker."""

MAX_MODEL_CHARS = 64
MAX_SUMMARY_CHARS = 400
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")


def check_model_name(name: object) -> str:
    """``name`` if it is a valid model name (the default ``""`` included), else ConfigError."""
    if not isinstance(name, str) or (name != DEFAULT_MODEL and not _NAME.match(name)):
        raise ConfigError(
            f"model_name must be 1 to {MAX_MODEL_CHARS} letters, digits, '.', '_' or '-' (not "
            f"starting with '.'), or '' for the cluster's default model; got {name!r}"
        )
    return name


def label(model: str) -> str:
    """How a model is named in messages: ``model 'trial-3'`` or ``the default model``."""
    return f"model {model!r}" if model else "the default model"


def model_workers(
    requested: Sequence[str | int] | None, cluster_workers: Sequence[str], task: str
) -> tuple[str, ...]:
    """The worker tasks of a model, in cluster order: ``requested`` (task names such as
    ``"worker:2"``, or indices of the worker job) or, when None, every worker of the
    cluster. ConfigError when one is not a worker of the cluster, the list is empty or has
    duplicates, or ``task`` (this process's) is not among them."""
    if requested is None:
        chosen = list(cluster_workers)
    else:
        if isinstance(requested, (str, bytes)) or not isinstance(requested, Sequence):
            raise ConfigError(
                f"model_workers must be a list of worker tasks ('worker:2' or 2), got {requested!r}"
            )
        chosen = [
            f"worker:{w}" if isinstance(w, int) and not isinstance(w, bool) else w
            for w in requested
        ]
        unknown = [w for w in chosen if w not in cluster_workers]
        if unknown or not chosen or len(set(chosen)) != len(chosen):
            raise ConfigError(
                f"model_workers must name distinct workers of the cluster "
                f"({', '.join(cluster_workers)}); got {list(requested)!r}"
            )
    if task not in chosen:
        raise ConfigError(
            f"{task} is not one of model_workers {chosen}: each worker trains the model whose "
            "model_workers name it"
        )
    return tuple(w for w in cluster_workers if w in chosen)


def fingerprint(variables: Sequence[tuple[str, Sequence[int], str]]) -> tuple[str, str]:
    """The SHA-256 of a model's variables (name, shape, dtype; in model order) and a short
    human summary of them, for the claim."""
    canonical = ";".join(f"{name}:{list(shape)}:{dtype}" for name, shape, dtype in variables)
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    parts = [f"{name} {dtype}{list(shape)}" for name, shape, dtype in variables]
    summary = f"{len(parts)} variables: " + ", ".join(parts)
    if len(summary) > MAX_SUMMARY_CHARS:
        summary = summary[: MAX_SUMMARY_CHARS - 3] + "..."
    return digest, summary


@dataclass(frozen=True)
class ModelClaim:
    """What a worker says about its model in its hello: the name, the model's workers and
    the fingerprint of its variables."""

    name: str = DEFAULT_MODEL
    workers: tuple[str, ...] | None = None
    """The model's worker tasks in cluster order; None: every worker of the cluster."""
    layout_sha256: str | None = None
    layout_summary: str = ""

    def __post_init__(self) -> None:
        check_model_name(self.name)

    @property
    def chief(self) -> str | None:
        """The model's chief: its first worker in cluster order (None: the cluster's chief)."""
        return self.workers[0] if self.workers else None

    def request_fields(self) -> dict[str, Any]:
        """What every request of this model carries (nothing for the default model)."""
        return {"model": self.name} if self.name else {}

    def hello_fields(self) -> dict[str, Any]:
        """What a hello carries: the name, the workers, the layout's fingerprint."""
        fields: dict[str, Any] = self.request_fields()
        if self.workers is not None:
            fields["model_workers"] = list(self.workers)
        if self.layout_sha256 is not None:
            fields["layout"] = {"sha256": self.layout_sha256, "summary": self.layout_summary}
        return fields

    @classmethod
    def from_hello(cls, body: dict[str, Any], cluster_workers: Sequence[str]) -> ModelClaim:
        """The claim of a hello (ProtocolError for malformed fields; never trusts sizes)."""
        name = body.get("model", DEFAULT_MODEL)
        try:
            check_model_name(name)
        except ConfigError as exc:
            raise ProtocolError(str(exc)) from None
        workers = body.get("model_workers")
        if workers is not None:
            if (
                not isinstance(workers, list)
                or not workers
                or len(workers) > len(cluster_workers)
                or len(set(map(str, workers))) != len(workers)
                or not all(isinstance(w, str) and w in cluster_workers for w in workers)
            ):
                raise ProtocolError(
                    f"hello for {label(name)}: 'model_workers' must list distinct workers of "
                    f"the cluster ({', '.join(cluster_workers)}), got {workers!r:.200}"
                )
            workers = tuple(w for w in cluster_workers if w in workers)
        layout = body.get("layout")
        digest, summary = None, ""
        if layout is not None:
            if (
                not isinstance(layout, dict)
                or not isinstance(layout.get("sha256"), str)
                or len(layout["sha256"]) != 64
                or not isinstance(layout.get("summary", ""), str)
            ):
                raise ProtocolError(f"hello for {label(name)}: malformed 'layout'")
            digest, summary = layout["sha256"], layout.get("summary", "")[:MAX_SUMMARY_CHARS]
        return cls(name, workers, digest, summary)

    def check_same_training(self, other: ModelClaim, shard: str, task: object) -> None:
        """RequestRefused when ``other`` (a new hello's claim, from ``task``) is another
        training than this one (the model's first claim): other workers, or another layout.
        Fields a claim leaves out are not compared."""
        workers_differ = (
            self.workers is not None and other.workers is not None and self.workers != other.workers
        )
        layout_differs = (
            self.layout_sha256 is not None
            and other.layout_sha256 is not None
            and self.layout_sha256 != other.layout_sha256
        )
        if workers_differ or layout_differs:
            raise RequestRefused(
                f"{shard}: two trainings claim {label(self.name)}: it is trained by "
                f"{_describe(self)}; {task} claims it for {_describe(other)}. Give each "
                "training its own model_name (and make every worker of one training build "
                "the same model)"
            )


def _describe(claim: ModelClaim) -> str:
    workers = ", ".join(claim.workers) if claim.workers else "every worker"
    layout = claim.layout_summary or "an unstated layout"
    return f"workers {workers} with {layout}"
