"""How a sweep's trial and the sweep talk: files in the trial's own directory.

The sweep gives each trial a directory (``$TENSORFLEET_TRIAL_DIR``) holding
``params.json``; the trial appends its metrics to ``metrics.jsonl`` there (one JSON object per
line: ``{"step": 3, "metrics": {"val_loss": 0.41}}``) and the sweep reads the new complete
lines as they come. To stop a trial early (pruned), the sweep writes ``stop`` there and then
signals the process; a cooperative trial sees it in :meth:`Trial.should_stop`.

Why files and not the wire: a trial is a child process on the sweep's machine (or a cluster
launched from it) and the sweep already owns its directory, so a file needs no port, no
secret and no server in the trial; what a trial reported stays on disk when the sweep is
killed, which is exactly what a resumed sweep needs; any program in any language can append a
JSON line; and nothing is ever unpickled: each line is parsed as JSON, checked (a mapping of
names to finite numbers), and a torn or malformed line is counted and skipped, never trusted.
Appends of one short line (``O_APPEND``, one ``write``) do not interleave between processes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorfleet import environment
from tensorfleet.cluster.resolver import resolve_task
from tensorfleet.errors import ConfigError, TensorfleetError

#: The trial's directory, set by the sweep for every trial process.
TRIAL_DIR_VAR = "TENSORFLEET_TRIAL_DIR"
#: The trial's parameters as JSON (also in ``params.json``), for programs in any language.
TRIAL_PARAMS_VAR = "TENSORFLEET_TRIAL_PARAMS"
#: The index of the slot the trial runs in (0 .. slots-1), e.g. to pick a device.
TRIAL_SLOT_VAR = "TENSORFLEET_TRIAL_SLOT"
PARAMS_FILE = "params.json"
METRICS_FILE = "metrics.jsonl"
#: What the trial process printed (stdout and stderr).
OUTPUT_FILE = "output.log"
STOP_FILE = "stop"
#: Written by the entry-point runner when the objective raised: the error, for the table.
ERROR_FILE = "error.json"
#: The longest metrics line read; anything longer is malformed.
MAX_LINE_BYTES = 64 * 1024


class NotInTrial(TensorfleetError, RuntimeError):
    """:func:`current_trial` was called outside of a sweep's trial."""


class TrialPruned(TensorfleetError):
    """Raise it from an objective that saw :meth:`Trial.should_stop`: the trial ends as
    pruned (not failed)."""


@dataclass
class Trial:
    """The running trial, as its own process sees it."""

    directory: Path
    number: int
    params: dict[str, Any]

    def report(self, step: int | None = None, **metrics: float) -> None:
        """Record ``metrics`` (name=value, finite numbers) at ``step``; the sweep shows them
        live and, with an Optuna pruner, may stop the trial. The last value of the sweep's
        metric is the trial's result. In a trial of several workers, report from the chief."""
        write_metrics(self.directory, metrics, step)

    def save_tensors(self, name: str, tensors: Mapping[str, Any]) -> Path:
        """Keep tensors for the sweep's caller (an ensemble's predictions, a fold's validation
        indices) as ``name.safetensors`` in the trial's directory; returns its path."""
        return save_trial_tensors(self.directory, name, tensors)

    def should_stop(self) -> bool:
        """Whether the sweep asked this trial to stop (it was pruned): finish the step and
        return (or raise :class:`TrialPruned`); the process is signalled shortly after."""
        return (self.directory / STOP_FILE).exists()


def current_trial(environ: Mapping[str, str] | None = None) -> Trial:
    """The trial this process runs, from ``$TENSORFLEET_TRIAL_DIR``."""
    env = environment.environ() if environ is None else environ
    where = env.get(TRIAL_DIR_VAR)
    if not where:
        raise NotInTrial(
            f"${TRIAL_DIR_VAR} is not set: this process was not started by a sweep. Run it "
            "through `tensorfleet sweep CONFIG` (or tensorfleet.patterns.sweep.run_sweep)"
        )
    directory = Path(where)
    try:
        record = json.loads((directory / PARAMS_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise NotInTrial(f"cannot read the trial's {directory / PARAMS_FILE}: {exc}") from exc
    return Trial(directory, int(record["number"]), dict(record["params"]))


def write_metrics(directory: Path, metrics: Mapping[str, float], step: int | None) -> None:
    """Append one metrics line to ``directory/metrics.jsonl`` (checked first)."""
    if not metrics:
        raise ConfigError("report() needs at least one metric, e.g. report(step, val_loss=0.3)")
    clean = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = float(value)  # a 0-dim tensor or a numpy scalar
            except (TypeError, ValueError):
                raise ConfigError(f"metric {name!r} must be a number, got {value!r}") from None
        if not math.isfinite(value):
            raise ConfigError(f"metric {name!r} is {value}; report finite values only")
        clean[name] = float(value)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigError(f"step must be a non-negative int, got {step!r}")
    line = (json.dumps({"step": step, "metrics": clean}) + "\n").encode()
    fd = os.open(directory / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@dataclass
class MetricPoint:
    """One reported line: its step (None when not given) and its metrics."""

    step: int | None
    metrics: dict[str, float]


@dataclass
class MetricsReader:
    """Reads the new complete lines of a trial's ``metrics.jsonl`` since the last call."""

    path: Path
    offset: int = 0
    malformed: int = 0
    points: list[MetricPoint] = field(default_factory=list)

    def read_new(self) -> list[MetricPoint]:
        """The points appended since the last call (complete lines only)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) > MAX_LINE_BYTES:  # one endless line: skip it
                self.offset += len(data)
                self.malformed += 1
            return []
        self.offset += end + 1
        new = []
        for raw in data[: end + 1].splitlines():
            point = _parse_line(raw)
            if point is None:
                self.malformed += 1
            else:
                new.append(point)
        self.points.extend(new)
        return new


def _parse_line(raw: bytes) -> MetricPoint | None:
    if not raw.strip() or len(raw) > MAX_LINE_BYTES:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("metrics"), dict):
        return None
    step = record.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        return None
    metrics = {}
    for name, value in record["metrics"].items():
        if (
            not isinstance(name, str)
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            return None
        metrics[name] = float(value)
    return MetricPoint(step, metrics)


def is_chief_process() -> bool:
    """Whether this process reports its trial's result: it is not a task of a cluster, or it
    is the chief (worker 0) of the trial's cluster."""
    task = resolve_task(allow_none=True, argv=[])
    return task is None or (task.job == "worker" and task.index == 0)


def save_trial_tensors(directory: Path, name: str, tensors: Mapping[str, Any]) -> Path:
    """Write ``tensors`` (name -> torch tensor) to ``directory/name.safetensors`` atomically."""
    from safetensors.torch import save_file

    if not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"tensor file name {name!r} must be letters, digits, '_' or '-'")
    path = directory / f"{name}.safetensors"
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)
    return path


def load_trial_tensors(directory: str | Path, name: str) -> dict[str, Any]:
    """The tensors a trial kept with :meth:`Trial.save_tensors` (safetensors: no code runs),
    from its directory (a path or a string)."""
    from safetensors.torch import load_file

    path = Path(directory) / f"{name}.safetensors"
    try:
        return load_file(str(path))
    except (OSError, ValueError) as exc:
        raise TensorfleetError(
            f"cannot read the tensors {path} a trial should have kept: {exc}"
        ) from exc
