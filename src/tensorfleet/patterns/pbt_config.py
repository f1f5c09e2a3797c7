"""Population-based training's configuration: the problem, the population, the
hyperparameters to search and how they are perturbed, the rounds.

The same :class:`PopulationConfig` comes from a YAML or JSON file (``tensorfleet pbt
CONFIG``) or is built in Python; :meth:`PopulationConfig.validate` checks it completely
before anything starts, and every error names the field, the value seen and the fix.

Example (YAML)::

    name: pbt-schedule
    problem: pbt_schedule.py:make_problem   # file (beside this config) or module, ':', factory
    problem_args: {features: 20}            # keyword arguments of the factory
    members: 4
    rounds: 12
    steps_per_round: 25
    rule: sgd
    fixed: {momentum: 0.0}                  # hyperparameters every member keeps
    hyperparameters:                        # what PBT searches: one value per member, or
      lr: {values: [0.8, 0.2, 0.05, 0.0125], low: 1.0e-4, high: 1.0}
      # weight_decay: {low: 1.0e-5, high: 1.0e-2, log: true}   # ... sampled from a range
    exploit_fraction: 0.25                  # the worst quarter copies the best quarter
    perturb: [0.8, 1.25]                    # explore: each value times one of these factors
    seed: 0
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import random
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from tensorfleet.errors import ConfigError
from tensorfleet.patterns.config_file import read_settings
from tensorfleet.ps.update_rules import UpdateRule


class PbtConfigError(ConfigError):
    """A PBT configuration is invalid (a field, a hyperparameter's range, the problem)."""


class PbtProblem(Protocol):
    """What each member of a population trains: the factory named by ``problem`` returns
    one. The driver builds every member's model, computes ``loss(...).backward()`` for each
    step and pushes the gradients to the member's namespace on the ps; after each round it
    ranks the members by ``evaluate`` (lower is better)."""

    def build_model(self, member: int) -> nn.Module:
        """A new model for ``member`` (0-based): its initial values."""
        ...

    def loss(self, model: nn.Module, step: int, member: int) -> torch.Tensor:
        """The training loss of the member's step ``step`` (its global step: the batch)."""
        ...

    def evaluate(self, model: nn.Module) -> float:
        """The member's score on held-out data; lower is better."""
        ...


@dataclass
class HyperparameterRange:
    """How one hyperparameter starts and where explore may take it."""

    values: list[float] | None = None
    """The members' initial values, one per member (else sampled in ``[low, high]``)."""
    low: float | None = None
    high: float | None = None
    log: bool = True
    """Sample (and keep) the value on a log scale (a learning rate): ``low`` > 0."""

    def initial(self, members: int, rng: random.Random) -> list[float]:
        if self.values is not None:
            return [float(v) for v in self.values]
        assert self.low is not None and self.high is not None
        if self.log:
            lo, hi = math.log(self.low), math.log(self.high)
            return [math.exp(rng.uniform(lo, hi)) for _ in range(members)]
        return [rng.uniform(self.low, self.high) for _ in range(members)]

    def clip(self, value: float) -> float:
        """``value`` within ``[low, high]`` (each bound that is set)."""
        if self.low is not None:
            value = max(value, self.low)
        if self.high is not None:
            value = min(value, self.high)
        return value


@dataclass
class PopulationConfig:
    """Everything a PBT run needs; see the module docstring for the file form."""

    problem: str
    """``file.py:factory`` or ``module:factory``: called with ``seed`` and ``problem_args``,
    it returns a :class:`PbtProblem`. A relative file is found beside the config file."""
    hyperparameters: Mapping[str, Any]
    """Name -> :class:`HyperparameterRange` (or its map form): what PBT searches."""
    problem_args: dict[str, Any] = field(default_factory=dict)
    members: int = 4
    rounds: int = 10
    steps_per_round: int = 20
    """Each member's steps between two exploit/explore points (the N of "every N steps")."""
    rule: str = "sgd"
    fixed: dict[str, Any] = field(default_factory=dict)
    """The update rule's hyperparameters that are not searched (the same for every member)."""
    exploit_fraction: float = 0.25
    """The worst this fraction of the members (at least one) copies one of the best as many."""
    perturb: list[float] = field(default_factory=lambda: [0.8, 1.25])
    exploit: bool = True
    """False: every member keeps its initial hyperparameters and state (the fixed-
    hyperparameter runs PBT is compared with, at the same budget)."""
    seed: int = 0
    round_timeout_s: float = 600.0
    """A round whose members have not all finished their steps after this long fails."""
    name: str = "pbt"
    base_dir: str = "."
    """Where a relative ``problem`` file is found (the config file's directory)."""

    def __post_init__(self) -> None:
        self.hyperparameters = {
            name: spec if isinstance(spec, HyperparameterRange) else _range(name, spec)
            for name, spec in dict(self.hyperparameters).items()
        }

    def validate(self) -> PopulationConfig:
        """Check every field (PbtConfigError naming the first wrong one); return self."""
        if not isinstance(self.members, int) or self.members < 2:
            raise PbtConfigError(f"members must be an integer >= 2, got {self.members!r}")
        for name in ("rounds", "steps_per_round"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PbtConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 < self.exploit_fraction <= 0.5:
            raise PbtConfigError(
                f"exploit_fraction must be in (0, 0.5] (the worst copy the best, as many), got "
                f"{self.exploit_fraction!r}"
            )
        if not self.perturb or not all(
            isinstance(f, (int, float)) and f > 0 and math.isfinite(f) for f in self.perturb
        ):
            raise PbtConfigError(
                f"perturb must list positive factors (e.g. [0.8, 1.25]), got {self.perturb!r}"
            )
        if not self.hyperparameters:
            raise PbtConfigError("hyperparameters must name at least one hyperparameter to search")
        for name, spec in self.hyperparameters.items():
            if name in self.fixed:
                raise PbtConfigError(
                    f"{name!r} is both searched (hyperparameters) and fixed: keep it in one"
                )
            if spec.values is not None and len(spec.values) != self.members:
                raise PbtConfigError(
                    f"hyperparameters.{name}.values has {len(spec.values)} values for "
                    f"{self.members} members: give one per member"
                )
        if not isinstance(self.problem, str) or ":" not in self.problem:
            raise PbtConfigError(
                f"problem must be 'file.py:factory' or 'module:factory', got {self.problem!r}"
            )
        if self.round_timeout_s <= 0:
            raise PbtConfigError(f"round_timeout_s must be > 0, got {self.round_timeout_s!r}")
        for values in self.initial_hyperparameters():
            self.rule_for(values)  # the rule accepts every member's hyperparameters
        return self

    def initial_hyperparameters(self) -> list[dict[str, float]]:
        """Each member's hyperparameters at the start (sampled ones from ``seed``)."""
        rng = random.Random(self.seed)
        columns = {n: s.initial(self.members, rng) for n, s in self.hyperparameters.items()}
        return [{n: columns[n][i] for n in columns} for i in range(self.members)]

    def rule_for(self, hyperparameters: Mapping[str, float]) -> UpdateRule:
        """The update rule of a member with these searched hyperparameters."""
        try:
            return UpdateRule(self.rule, {**self.fixed, **hyperparameters})
        except ValueError as exc:
            raise PbtConfigError(
                f"rule {self.rule!r} with {dict(hyperparameters)}: {exc}"
            ) from None

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the run it resumes (all but ``rounds``, the
        timeout and where the problem was found)."""
        data = asdict(self)
        for key in ("rounds", "round_timeout_s", "base_dir"):
            data.pop(key)
        return json.loads(json.dumps(data))

    def load_problem(self) -> PbtProblem:
        """Call the ``problem`` factory with ``seed`` and ``problem_args``."""
        where, _, attribute = self.problem.rpartition(":")
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_absolute():
                path = Path(self.base_dir) / path
            if not path.is_file():
                raise PbtConfigError(
                    f"problem file {str(path.resolve())!r} does not exist ({self.problem!r}, "
                    f"relative to {str(Path(self.base_dir).resolve())!r}: the config file's "
                    "directory, or the working directory for a PopulationConfig made in Python); "
                    "fix: give the file's path from there, or an absolute one"
                )
            module_name = f"_tensorfleet_pbt_problem_{path.stem}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        else:
            try:
                module = importlib.import_module(where)
            except ImportError as exc:
                raise PbtConfigError(
                    f"problem module {where!r} cannot be imported: {exc}"
                ) from None
        factory = getattr(module, attribute, None)
        if not callable(factory):
            raise PbtConfigError(f"problem {self.problem!r}: {where} has no function {attribute!r}")
        problem = factory(seed=self.seed, **self.problem_args)
        missing = [m for m in ("build_model", "loss", "evaluate") if not hasattr(problem, m)]
        if missing:
            raise PbtConfigError(
                f"problem {self.problem!r} returned {type(problem).__name__}, which lacks "
                f"{', '.join(missing)} (see PbtProblem)"
            )
        return problem


def _range(name: str, spec: object) -> HyperparameterRange:
    if isinstance(spec, list):
        spec = {"values": spec}
    if not isinstance(spec, Mapping):
        raise PbtConfigError(
            f"hyperparameters.{name} must be a map (values, low, high, log) or a list of "
            f"values, got {spec!r}"
        )
    unknown = set(spec) - {f.name for f in fields(HyperparameterRange)}
    if unknown:
        raise PbtConfigError(
            f"hyperparameters.{name}: unknown field(s) {sorted(unknown)}; known: values, low, "
            "high, log"
        )
    result = HyperparameterRange(**spec)
    numbers = [v for v in (result.low, result.high) if v is not None] + list(result.values or [])
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers):
        raise PbtConfigError(
            f"hyperparameters.{name}: every value must be a finite number, got {spec}"
        )
    if result.values is None and (result.low is None or result.high is None):
        raise PbtConfigError(f"hyperparameters.{name}: give values, or low and high to sample from")
    if result.low is not None and result.high is not None and not result.low < result.high:
        raise PbtConfigError(f"hyperparameters.{name}: low must be < high, got {spec}")
    if result.log and result.low is not None and result.low <= 0:
        raise PbtConfigError(
            f"hyperparameters.{name}: a log-scale range needs low > 0, got low={result.low} "
            "(or set log: false)"
        )
    return result


def load_config(path: str | Path) -> PopulationConfig:
    """The PBT configuration in a YAML (``.yaml``/``.yml``, needs PyYAML) or JSON file,
    checked; a relative ``problem`` file is found beside it."""
    path = Path(path)
    raw = read_settings(path, PbtConfigError, "PBT config", "pip install pyyaml")
    known = {f.name for f in fields(PopulationConfig)} - {"base_dir"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise PbtConfigError(f"{path}: unknown setting(s) {unknown}; known: {sorted(known)}")
    for required in ("problem", "hyperparameters"):
        if required not in raw:
            raise PbtConfigError(f"{path}: '{required}' is required")
    try:
        config = PopulationConfig(**raw, base_dir=str(path.resolve().parent))
    except TypeError as exc:
        raise PbtConfigError(f"{path}: {exc}") from None
    return config.validate()
