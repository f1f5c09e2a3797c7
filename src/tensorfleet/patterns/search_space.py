"""The parameter space of a sweep: what each parameter may take, checked before anything runs.

A space is a mapping from parameter name to a :class:`Parameter`. Four kinds cover what
hyperparameter searches use (the same as Optuna's ``suggest_*`` family, so a space maps onto
Optuna's samplers one to one), each with its own keys (any other key is refused):

* ``choice``: one of ``values``, a list of numbers, strings or booleans (a bare list is
  shorthand for a choice);
* ``int``: an integer in ``[low, high]``; ``step`` (default 1) for the grid and the draws;
  ``log: true`` for a log scale (then no ``step``; a grid search takes ``grid`` points,
  default 5, rounded to integers, repeats dropped);
* ``float``: a float in ``[low, high]``; ``log: true`` for a log scale; ``grid``: how many
  evenly (or log-evenly) spaced points, ends included, a grid search tries (default
  :data:`DEFAULT_GRID_POINTS`);
* ``loguniform``: shorthand for ``float`` with ``log: true``.

A grid search tries every combination of the parameters' grid values: a choice's values, an
int range's steps, a float range's ``grid`` points; :func:`grid_summary` is the one line the
sweep prints about it before it starts. Why a separate module: the same space drives grid,
random and Optuna search, and the config file, the Python API and the errors must agree on it.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tensorfleet.errors import TensorfleetError

Value = int | float | str | bool
KINDS = ("choice", "int", "float", "loguniform")
#: Points of a float range in a grid search when the parameter does not say.
DEFAULT_GRID_POINTS = 5
#: The keys each kind of parameter takes.
_KEYS = {
    "choice": {"type", "values"},
    "int": {"type", "low", "high", "step", "log", "grid"},
    "float": {"type", "low", "high", "log", "grid"},
    "loguniform": {"type", "low", "high", "log", "grid"},
}


class SweepConfigError(TensorfleetError, ValueError):
    """A sweep's configuration (its space, metric, slots or trial program) is invalid."""


@dataclass(frozen=True)
class Parameter:
    """One parameter of the space; build it with :func:`parse_parameter`."""

    name: str
    kind: str
    values: tuple[Value, ...] = ()
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: int = 1
    grid: int = DEFAULT_GRID_POINTS
    grid_given: bool = False
    """Whether the config set ``grid`` (else :data:`DEFAULT_GRID_POINTS`, said at the start)."""

    def grid_values(self) -> list[Value]:
        """The values a grid search tries, in order."""
        if self.kind == "choice":
            return list(self.values)
        if self.kind == "int":
            if self.log:
                return sorted({round(v) for v in _spaced(self.low, self.high, self.grid, True)})
            return list(range(int(self.low), int(self.high) + 1, self.step))
        return _spaced(self.low, self.high, self.grid, self.log)

    def sample(self, rng: random.Random) -> Value:
        """One value drawn at random (uniformly, or log-uniformly with ``log``)."""
        if self.kind == "choice":
            return self.values[rng.randrange(len(self.values))]
        if self.kind == "int":
            if self.log:
                return round(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))
            return rng.randrange(int(self.low), int(self.high) + 1, self.step)
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)

    def suggest(self, trial: Any) -> Value:
        """The value an Optuna trial suggests for this parameter."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.name, list(self.values))
        if self.kind == "int":
            return trial.suggest_int(
                self.name, int(self.low), int(self.high), step=self.step, log=self.log
            )
        return trial.suggest_float(self.name, self.low, self.high, log=self.log)

    def describe(self) -> dict[str, Any]:
        """This parameter as the mapping a config file holds (stored with the sweep)."""
        if self.kind == "choice":
            return {"type": "choice", "values": list(self.values)}
        out: dict[str, Any] = {"type": self.kind, "low": self.low, "high": self.high}
        if self.log:
            out["log"] = True
        if self.kind == "int":
            out["step"] = self.step
            if self.log and self.grid != DEFAULT_GRID_POINTS:
                out["grid"] = self.grid
        else:
            out["grid"] = self.grid
        return out


def _spaced(low: float, high: float, points: int, log: bool) -> list[float]:
    if points == 1:
        return [low]
    if log:
        a, b = math.log(low), math.log(high)
        return [math.exp(a + (b - a) * i / (points - 1)) for i in range(points)]
    return [low + (high - low) * i / (points - 1) for i in range(points)]


def parse_parameter(name: str, spec: object) -> Parameter:
    """A :class:`Parameter` from its config form; :class:`SweepConfigError` naming the
    parameter, the value seen and the fix when it is not valid.

    A bare list is shorthand for ``{"type": "choice", "values": [...]}``.
    """
    where = f"parameter {name!r}"
    if not isinstance(name, str) or not name.isidentifier():
        raise SweepConfigError(
            f"parameter name {name!r} is not an identifier; use letters, digits and _ "
            "(it becomes a keyword and a {placeholder} in the command)"
        )
    if isinstance(spec, list):
        spec = {"type": "choice", "values": spec}
    if not isinstance(spec, Mapping):
        raise SweepConfigError(
            f"{where}: expected a mapping such as {{type: float, low: 0.001, high: 0.1}} or a "
            f"list of choices, got {type(spec).__name__} {spec!r}"
        )
    kind = spec.get("type")
    if kind not in KINDS:
        raise SweepConfigError(
            f"{where}: unknown parameter type {kind!r}; the types are {', '.join(KINDS)}"
        )
    known = _KEYS[kind]
    unknown = sorted(set(spec) - known)
    if unknown:
        raise SweepConfigError(
            f"{where}: unknown keys {unknown} for type {kind}; a {kind} parameter takes "
            f"{sorted(known)}"
        )
    if kind == "choice":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise SweepConfigError(
                f"{where}: a choice needs a non-empty list of values, got {values!r}"
            )
        bad = [v for v in values if not isinstance(v, (int, float, str, bool))]
        if bad:
            raise SweepConfigError(
                f"{where}: choices must be numbers, strings or booleans, got {bad!r}"
            )
        if len(set(map(repr, values))) != len(values):
            raise SweepConfigError(f"{where}: the choices {values!r} repeat a value")
        return Parameter(name, "choice", values=tuple(values))
    low, high = spec.get("low"), spec.get("high")
    for label, bound in (("low", low), ("high", high)):
        if (
            isinstance(bound, bool)
            or not isinstance(bound, (int, float))
            or not math.isfinite(bound)
        ):
            raise SweepConfigError(f"{where}: {label} must be a finite number, got {bound!r}")
    assert isinstance(low, (int, float)) and isinstance(high, (int, float))
    if not low <= high:
        raise SweepConfigError(f"{where}: low {low} is above high {high}; swap them")
    if "log" in spec and not isinstance(spec["log"], bool):
        raise SweepConfigError(f"{where}: log must be true or false, got {spec['log']!r}")
    if kind == "loguniform" and spec.get("log") is False:
        raise SweepConfigError(
            f"{where}: a loguniform range is log-scaled (log: false contradicts it); use type: "
            "float for a linear range"
        )
    log = bool(spec.get("log", False)) or kind == "loguniform"
    if log and low <= 0:
        raise SweepConfigError(f"{where}: a log scale needs low > 0, got low={low}")
    grid = spec.get("grid", DEFAULT_GRID_POINTS)
    if not isinstance(grid, int) or isinstance(grid, bool) or grid < 1:
        raise SweepConfigError(f"{where}: grid must be an integer >= 1, got {grid!r}")
    step = spec.get("step", 1)  # a float range has none (its keys refuse it)
    if kind == "int":
        if int(low) != low or int(high) != high:
            raise SweepConfigError(f"{where}: an int range needs integer bounds, got {low}..{high}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise SweepConfigError(f"{where}: step must be an integer >= 1, got {step!r}")
        if log and step != 1:
            raise SweepConfigError(f"{where}: a log-scaled int range takes no step (got {step})")
        if "grid" in spec and not log:
            raise SweepConfigError(
                f"{where}: grid (points of a grid search) is for float and log-scaled int "
                f"ranges; a linear int range tries every step from low to high (set step, "
                f"got grid={grid!r})"
            )
    cast, kind = (int, "int") if kind == "int" else (float, "float")  # loguniform: a float
    return Parameter(
        name,
        kind,
        low=cast(low),
        high=cast(high),
        log=log,
        step=step,
        grid=grid,
        grid_given="grid" in spec,
    )


def parse_space(space: object) -> dict[str, Parameter]:
    """The whole space from its config form: a non-empty mapping of parameters."""
    if not isinstance(space, Mapping):
        raise SweepConfigError(
            f"space must be a mapping of parameter name to its range, got {type(space).__name__}"
        )
    if not space:
        raise SweepConfigError(
            "the parameter space is empty: give at least one parameter, e.g. "
            "space: {lr: {type: loguniform, low: 1e-4, high: 1e-1}}"
        )
    return {name: parse_parameter(name, spec) for name, spec in space.items()}


def grid(space: Mapping[str, Parameter]) -> Iterator[dict[str, Value]]:
    """Every combination of the parameters' grid values, the last parameter varying fastest."""
    names = list(space)
    for combo in itertools.product(*(space[n].grid_values() for n in names)):
        yield dict(zip(names, combo, strict=True))


def grid_summary(space: Mapping[str, Parameter]) -> str:
    """One line saying how many trials a grid search over ``space`` runs and why, naming the
    ranges that use the default number of points (the number is not in the config)."""
    sizes = " x ".join(f"{name} {len(p.grid_values())}" for name, p in space.items())
    defaulted = [
        name
        for name, p in space.items()
        if (p.kind == "float" or (p.kind == "int" and p.log)) and not p.grid_given
    ]
    size = grid_size(space)
    line = f"grid search: {size} trial{'' if size == 1 else 's'} ({sizes})"
    if defaulted:
        line += (
            f"; {', '.join(defaulted)}: {DEFAULT_GRID_POINTS} points (the default; set grid: N "
            "on the parameter for another number)"
        )
    return line


def grid_size(space: Mapping[str, Parameter]) -> int:
    """The number of configurations :func:`grid` yields."""
    return math.prod(len(p.grid_values()) for p in space.values())


def random_configuration(
    space: Mapping[str, Parameter], seed: int, number: int
) -> dict[str, Value]:
    """Trial ``number``'s configuration of a random search with ``seed``: a pure function of
    both, so that a resumed sweep draws exactly the configurations it drew before."""
    rng = random.Random(f"{seed}/{number}")
    return {name: p.sample(rng) for name, p in space.items()}
