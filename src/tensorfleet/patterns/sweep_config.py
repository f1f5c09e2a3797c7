"""A sweep's configuration: the trial program, the space, the metric, the search, the slots.

The same :class:`SweepConfig` comes from a YAML or JSON file (``tensorfleet sweep CONFIG``) or
is built in Python; either way it is checked completely in :meth:`SweepConfig.validate`
before a single trial starts, and every error names the field, the value seen and the fix.

Example (YAML)::

    entry: my_trials:train          # or command: [python, train.py, --lr, "{lr}"]
    space:
      lr: {type: loguniform, low: 1.0e-4, high: 1.0e-1}
      width: [32, 64]
    metric: val_loss
    direction: minimize
    search: grid                    # grid | random | optuna
    slots: 2
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tensorfleet.patterns.config_file import read_settings
from tensorfleet.patterns.search_space import Parameter, SweepConfigError, grid_size, parse_space

SEARCHES = ("grid", "random", "optuna", "list")
DIRECTIONS = ("minimize", "maximize")
SAMPLERS = ("tpe", "random", "cmaes", "qmc", "gp")
PRUNERS = ("none", "median", "successive_halving", "hyperband")
EXECUTORS = ("warm", "fresh")
#: Packages a sampler needs beyond Optuna.
_SAMPLER_NEEDS = {"cmaes": ("cmaes",), "qmc": ("scipy",), "gp": ("scipy", "torch")}
#: The Optuna class of each pruner; ``pruner_options`` are its keyword arguments.
PRUNER_CLASSES = {
    "median": "MedianPruner",
    "successive_halving": "SuccessiveHalvingPruner",
    "hyperband": "HyperbandPruner",
}
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass
class SweepConfig:
    """Everything a sweep needs; see the module docstring for the file form."""

    space: Mapping[str, Any]
    """Parameter name -> its range (see :mod:`tensorfleet.patterns.search_space`)."""
    metric: str
    entry: str | None = None
    """A Python function ``module:function`` called with the trial (one process per trial)."""
    command: list[str] | None = None
    """Or a program; ``{name}`` in an argument is replaced by the parameter's value, and
    ``{python}`` by the sweep's own Python interpreter."""
    direction: str = "minimize"
    search: str = "grid"
    """``grid``, ``random``, ``optuna``, or ``list`` (the given ``configurations``, in order)."""
    configurations: list[dict[str, Any]] | None = None
    """search: list runs exactly these configurations (ensemble members, folds); the space
    may then be left out of a config file, or given as ``{}`` here (each parameter becomes a
    choice of the values it takes)."""
    trials: int | None = None
    """How many trials (random and optuna search; a grid runs all its points)."""
    slots: int = 1
    """Trials running at once; each slot is one process, or one local cluster."""
    workers_per_trial: int = 1
    """More than 1: each trial is a local cluster of this many workers (and ``ps_per_trial``
    ps tasks) started through ``tensorfleet launch``; a slot is then the whole group."""
    ps_per_trial: int = 1
    seed: int = 0
    sampler: str = "tpe"
    pruner: str = "none"
    pruner_options: dict[str, Any] = field(default_factory=dict)
    trial_timeout_s: float | None = None
    """A trial still running after this many seconds is stopped and recorded as failed."""
    name: str = "sweep"
    """The Optuna study's name, and the sweep directory ``runs/<name>`` when ``--dir`` is not
    given."""
    pythonpath: list[str] = field(default_factory=list)
    """Directories put in front of ``PYTHONPATH`` for the trials (the config file's directory
    is added when the config comes from a file)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for every trial (on top of the sweep's own)."""
    executor: str = "warm"
    """Where an ``entry`` trial of one worker runs: ``warm`` (default), a process forked from
    its slot's executor, which imported torch, tensorfleet and the entry's module once
    (:mod:`tensorfleet.patterns.warm_executor`); ``fresh``, a new interpreter per trial (for an
    entry whose module must be imported anew by every trial). Commands and trials of several
    workers always run in fresh processes. Not part of the stored configuration: a sweep may
    be resumed with the other one."""
    parameters: dict[str, Parameter] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`SweepConfigError` for anything that would fail later."""
        if self.configurations is not None:
            self._derive_space()
        elif self.search == "list":
            raise SweepConfigError("search: list needs configurations (a list of mappings)")
        self.parameters = parse_space(self.space)
        if (self.entry is None) == (self.command is None):
            raise SweepConfigError(
                "give exactly one trial program: entry ('module:function') or command (a list "
                f"of arguments); got entry={self.entry!r}, command={self.command!r}"
            )
        if self.entry is not None and (
            not isinstance(self.entry, str) or not re.fullmatch(r"[\w.]+:[\w.]+", self.entry)
        ):
            raise SweepConfigError(f"entry must be 'module:function', got {self.entry!r}")
        if self.command is not None:
            if (
                not isinstance(self.command, list)
                or not self.command
                or not all(isinstance(a, str) for a in self.command)
            ):
                raise SweepConfigError(
                    f"command must be a non-empty list of strings, got {self.command!r}"
                )
            if "python" in self.parameters:
                raise SweepConfigError(
                    "a parameter may not be called 'python': {python} in a command is the "
                    "sweep's interpreter"
                )
            for arg in self.command:
                for name in _PLACEHOLDER.findall(arg):
                    if name not in self.parameters and name != "python":
                        raise SweepConfigError(
                            f"command argument {arg!r} names {{{name}}}, which is not a parameter "
                            f"of the space ({sorted(self.parameters)})"
                        )
        if not isinstance(self.metric, str) or not self.metric:
            raise SweepConfigError(f"metric must be a non-empty name, got {self.metric!r}")
        _one_of("direction", self.direction, DIRECTIONS)
        _one_of("search", self.search, SEARCHES)
        _one_of("sampler", self.sampler, SAMPLERS)
        _one_of("pruner", self.pruner, PRUNERS)
        _one_of("executor", self.executor, EXECUTORS)
        for label, value, low in (
            ("slots", self.slots, 1),
            ("workers_per_trial", self.workers_per_trial, 1),
            ("ps_per_trial", self.ps_per_trial, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SweepConfigError(f"{label} must be an integer >= {low}, got {value!r}")
        if self.search == "list":
            pass
        elif self.search == "grid":
            if self.trials is not None and self.trials != grid_size(self.parameters):
                raise SweepConfigError(
                    f"a grid search runs its {grid_size(self.parameters)} points; trials="
                    f"{self.trials} does not match (leave trials out)"
                )
        elif isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise SweepConfigError(
                f"{self.search} search needs trials: an integer >= 1, got {self.trials!r}"
            )
        if self.pruner != "none" and self.search != "optuna":
            raise SweepConfigError(
                f"pruner {self.pruner!r} needs search: optuna (grid and random search run "
                "every trial to its end)"
            )
        if self.search == "optuna":
            check_sampler_packages(self.sampler)
        if self.pruner != "none":
            check_pruner_options(self.pruner, self.pruner_options)
        elif self.pruner_options:
            raise SweepConfigError(
                f"pruner_options {self.pruner_options} are given but pruner is 'none'; set "
                f"pruner ({', '.join(PRUNERS[1:])}) or leave pruner_options out"
            )
        if self.trial_timeout_s is not None and not self.trial_timeout_s > 0:
            raise SweepConfigError(f"trial_timeout_s must be > 0, got {self.trial_timeout_s!r}")
        _check_pythonpath(self.pythonpath)
        if not isinstance(self.env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise SweepConfigError(
                f"env must map variable names to strings, got {self.env!r}; quote numbers "
                '(e.g. env: {OMP_NUM_THREADS: "1"})'
            )
        if not isinstance(self.name, str) or not re.fullmatch(r"[\w.-]+", self.name):
            raise SweepConfigError(
                f"name must be letters, digits, '_', '.', '-', got {self.name!r}"
            )

    def _derive_space(self) -> None:
        configs = self.configurations
        if (
            not isinstance(configs, list)
            or not configs
            or not all(isinstance(c, dict) and c for c in configs)
        ):
            raise SweepConfigError(
                f"configurations must be a non-empty list of non-empty mappings, got {configs!r}"
            )
        keys = set(configs[0])
        for number, config in enumerate(configs):
            if set(config) != keys:
                raise SweepConfigError(
                    f"configuration {number} has the parameters {sorted(config)}, the first one "
                    f"{sorted(keys)}: every configuration must name the same parameters"
                )
        if self.search != "list":
            raise SweepConfigError(f"configurations need search: list, got search: {self.search!r}")
        values: dict[str, list[Any]] = {k: [] for k in configs[0]}
        for config in configs:
            for k, v in config.items():
                if v not in values[k]:
                    values[k].append(v)
        self.space = {k: {"type": "choice", "values": v} for k, v in values.items()}

    @property
    def total_trials(self) -> int:
        """How many trials the sweep runs to an end."""
        if self.search == "grid":
            return grid_size(self.parameters)
        if self.search == "list":
            return len(self.configurations or [])
        return int(self.trials or 0)

    def describe(self) -> dict[str, Any]:
        """The configuration as stored with the sweep (to refuse resuming another one)."""
        return {
            "space": {n: p.describe() for n, p in self.parameters.items()},
            "metric": self.metric,
            "direction": self.direction,
            "search": self.search,
            "configurations": self.configurations,
            "trials": self.total_trials,
            "seed": self.seed,
            "sampler": self.sampler,
            "pruner": self.pruner,
            "entry": self.entry,
            "command": self.command,
            "workers_per_trial": self.workers_per_trial,
        }


def check_sampler_packages(sampler: str) -> None:
    """Refuse a sampler whose packages are missing (Optuna would only fail in the middle of
    the sweep, at the first trial it samples, with a bare ModuleNotFoundError)."""
    missing = [m for m in _SAMPLER_NEEDS.get(sampler, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise SweepConfigError(
            f"sampler: {sampler} needs the package(s) {missing}, which are not installed: "
            f"pip install {' '.join(missing)} (or choose sampler: tpe or random)"
        )


def check_pruner_options(pruner: str, options: object) -> None:
    """Refuse ``pruner_options`` that Optuna's pruner class would not take, naming the
    accepted ones (read from the class's signature, so they are those of the installed
    Optuna); the pruner is built once to catch out-of-range values too."""
    try:
        import optuna
    except ImportError:
        raise SweepConfigError(
            f"pruner: {pruner} needs Optuna: pip install 'tensorfleet[sweep]'"
        ) from None
    if not isinstance(options, Mapping):
        raise SweepConfigError(
            f"pruner_options must be a mapping of option to value, got {options!r}"
        )
    cls = getattr(optuna.pruners, PRUNER_CLASSES[pruner])
    accepted = {
        name: param.default
        for name, param in inspect.signature(cls).parameters.items()
        if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
    }
    takes = ", ".join(
        name if default is inspect.Parameter.empty else f"{name} (default {default!r})"
        for name, default in accepted.items()
    )
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise SweepConfigError(
            f"pruner_options {dict(options)} for {pruner}: unknown option(s) {unknown}; "
            f"optuna.pruners.{cls.__name__} takes {takes}"
        )
    try:
        cls(**options)
    except (TypeError, ValueError) as exc:
        raise SweepConfigError(
            f"pruner_options {dict(options)} for {pruner}: {exc}; "
            f"optuna.pruners.{cls.__name__} takes {takes}"
        ) from None


def _check_pythonpath_type(pythonpath: object) -> list[str]:
    """``pythonpath`` itself when it is a list of strings."""
    if not isinstance(pythonpath, list) or not all(isinstance(p, str) for p in pythonpath):
        raise SweepConfigError(
            f"pythonpath must be a list of directories, got {pythonpath!r} (e.g. pythonpath: [src])"
        )
    return pythonpath


def _check_pythonpath(pythonpath: object, relative_to: str = "the working directory") -> None:
    """A list of paths that exist: an entry that does not would leave the trials' imports
    failing one by one, each saying only that a module is missing."""
    missing = [p for p in _check_pythonpath_type(pythonpath) if not os.path.exists(p)]
    if missing:
        raise SweepConfigError(
            f"pythonpath names {len(missing)} path(s) that do not exist: "
            + ", ".join(repr(p) for p in missing)
            + f" (absolute: {', '.join(os.path.abspath(p) for p in missing)}; a relative entry "
            f"is taken from {relative_to}): correct or remove them"
        )


def _one_of(label: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SweepConfigError(f"{label} must be one of {', '.join(allowed)}; got {value!r}")


def load_config(path: str | Path) -> SweepConfig:
    """The sweep configuration in a YAML (``.yaml``/``.yml``, needs PyYAML) or JSON file."""
    path = Path(path)
    raw = read_settings(path, SweepConfigError, "sweep config", "pip install 'tensorfleet[sweep]'")
    known = {f.name for f in fields(SweepConfig) if f.init}
    unknown = sorted(set(raw) - known)
    if unknown:
        guesses = {u: difflib.get_close_matches(u, known, n=1) for u in unknown}
        meant = "; ".join(f"{u!r}: did you mean {g[0]!r}?" for u, g in guesses.items() if g)
        raise SweepConfigError(
            f"{path}: unknown settings {unknown}"
            + (f" ({meant})" if meant else "")
            + f"; the settings are {sorted(known)}"
        )
    listed = raw.get("search") == "list"  # its space may be left out (from configurations)
    for required in ("metric",) if listed else ("space", "metric"):
        if required not in raw:
            raise SweepConfigError(f"{path}: missing setting {required!r}")
    if listed:
        raw.setdefault("space", {})
    raw.setdefault("pythonpath", [])
    try:
        _check_pythonpath_type(raw["pythonpath"])  # where the entries lie: once resolved
    except SweepConfigError as exc:
        raise SweepConfigError(f"{path}: {exc}") from None
    raw["pythonpath"] = [str((path.parent / p).resolve()) for p in raw["pythonpath"]] + [
        str(path.parent.resolve())
    ]
    try:
        _check_pythonpath(
            raw["pythonpath"], f"the config file's directory, {path.parent.resolve()}"
        )
    except SweepConfigError as exc:
        raise SweepConfigError(f"{path}: {exc}") from None
    try:
        return SweepConfig(**raw)
    except SweepConfigError as exc:
        raise SweepConfigError(f"{path}: {exc}") from None
