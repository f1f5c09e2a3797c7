"""Row-sparse update rules: how a ps shard applies a gradient that touches only some rows.

A sparse gradient arrives as unique row indices plus one gradient row per index (see
:mod:`tensorfleet.ps.sparse_rows`). The rules here update only those rows of the stored
values and of the per-row optimizer state ("slots"), and are bit for bit what the matching
``torch.optim`` optimizer does to a parameter given the same sparse COO gradient:

* ``sgd``: ``torch.optim.SGD`` (no momentum, no weight decay: torch's momentum buffer for a
  sparse gradient decays every row at every step, which is not row-sparse; torch refuses
  weight decay for sparse gradients in Adagrad and it would densify SGD's gradient).
* ``adagrad``: ``torch.optim.Adagrad`` (slot ``sum``; ``lr_decay`` and
  ``initial_accumulator_value`` supported, weight decay refused as torch does).
* ``sparse_adam``: lazy Adam, ``torch.optim.SparseAdam``: the moments ``exp_avg`` and
  ``exp_avg_sq`` of the touched rows only; bias correction uses the table's step count.

Why bit-exact by construction rather than by luck: every scatter into the stored tensors
goes through the same kernel torch uses (``dense.add_(sparse_coo, alpha=...)``, whose CPU
path is one ``axpy`` per row), every gather is a copy (``index_select``), and the elementwise
arithmetic is the same sequence of tensor operations as torch's source, on the same
``[rows, dim]`` shapes. So a row's bits depend only on that row's inputs: the rows may live
at any slot of any shard (lazily created, permuted, split over several shards).

The step count is per table, as in torch (one ``optimizer.step()`` per training step, even
when a step touched no row): a shard holding part of a table must be told about every step,
with an empty gradient when none of its rows was touched (:meth:`SparseRowRule.apply` with
zero rows still advances the step). The caller keeps the step count; the rule is stateless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorfleet.errors import TensorfleetError


class SparseRuleError(TensorfleetError, ValueError):
    """A row-sparse update rule was asked for something it cannot do exactly."""


#: Each rule: allowed hyperparameters with their defaults (torch's), and its per-row slots.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.01},
    "adagrad": {"lr": 0.01, "lr_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10},
    "sparse_adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8},
}
#: Hyperparameters torch has for the dense rule that have no exact row-sparse meaning.
_REFUSED = {
    "sgd": {
        "momentum": "torch's momentum buffer for a sparse gradient decays every row at every "
        "step, so the update is not row-sparse; use sparse_adam or adagrad for adaptive "
        "per-row updates",
        "weight_decay": "weight decay reads every row (it would make the gradient dense)",
        "nesterov": "nesterov needs momentum, which is not row-sparse",
        "dampening": "dampening needs momentum, which is not row-sparse",
    },
    "adagrad": {"weight_decay": "torch refuses weight_decay with sparse gradients"},
    "adam": {
        "*": "dense Adam decays every row's moments at every step; use sparse_adam "
        "(lazy Adam, torch.optim.SparseAdam) for a row-sparse table"
    },
}
#: Names accepted for the same rule (the dense rules' names map to their sparse variant).
_ALIASES = {"lazy_adam": "sparse_adam", "sparseadam": "sparse_adam"}


@dataclass(frozen=True)
class SparseRowRule:
    """A row-sparse update rule by name with its hyperparameters (torch's defaults filled in).

    >>> rule = SparseRowRule("adagrad", {"lr": 0.1})
    >>> rule.slot_names
    ('sum',)
    """

    name: str
    hyperparameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        name = _ALIASES.get(self.name, self.name)
        object.__setattr__(self, "name", name)
        refused = _REFUSED.get(name, {})
        if "*" in refused:
            raise SparseRuleError(
                f"update rule {name!r} cannot update a sparse table row by row: {refused['*']}"
            )
        if name not in _DEFAULTS:
            raise SparseRuleError(
                f"unknown row-sparse update rule {self.name!r}; known: {sorted(_DEFAULTS)} "
                f"(and the aliases {sorted(_ALIASES)})"
            )
        hyper = dict(_DEFAULTS[name])
        for key, value in self.hyperparameters.items():
            if key in refused:
                if _is_neutral(key, value):
                    continue  # momentum=0, weight_decay=0, nesterov=False: harmless
                raise SparseRuleError(
                    f"hyperparameter {key}={value!r} of rule {name!r} is not supported for "
                    f"sparse gradients: {refused[key]}; set it to 0/False for this table"
                )
            if key not in hyper:
                raise SparseRuleError(
                    f"unknown hyperparameter {key!r} for row-sparse rule {name!r}; "
                    f"allowed: {sorted(hyper)}"
                )
            hyper[key] = tuple(value) if isinstance(value, list) else value
        _check_numbers(name, hyper)
        object.__setattr__(self, "hyperparameters", hyper)

    @classmethod
    def from_dense(cls, name: str, hyperparameters: dict[str, Any]) -> SparseRowRule:
        """The row-sparse rule for a dense rule's name (``adam`` is refused with the fix).
        ``foreach`` and ``fused`` choose torch's implementation of the dense rule, not its
        arithmetic: a table's rows have their own, so they are dropped."""
        implementation = ("foreach", "fused")
        return cls(name, {k: v for k, v in hyperparameters.items() if k not in implementation})

    @property
    def slot_names(self) -> tuple[str, ...]:
        """The per-row optimizer state this rule keeps, one ``[rows, dim]`` tensor each."""
        return {"sgd": (), "adagrad": ("sum",), "sparse_adam": ("exp_avg", "exp_avg_sq")}[self.name]

    def slot_initial_value(self, slot: str) -> float:
        """The value a slot row has before its row's first update (torch's initial state)."""
        if slot == "sum":
            return float(self.hyperparameters["initial_accumulator_value"])
        return 0.0

    def to_wire(self) -> dict[str, Any]:
        """The msgpack/JSON form (tuples as lists)."""
        return {
            "name": self.name,
            "hyperparameters": {
                k: list(v) if isinstance(v, tuple) else v for k, v in self.hyperparameters.items()
            },
        }

    @classmethod
    def from_wire(cls, data: object) -> SparseRowRule:
        """Parse a rule received from a peer or read from a checkpoint (SparseRuleError)."""
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("name"), str)
            or not isinstance(data.get("hyperparameters"), dict)
        ):
            raise SparseRuleError(
                f"a row-sparse rule is {{name: str, hyperparameters: map}}, got {data!r}"
            )
        return cls(data["name"], dict(data["hyperparameters"]))

    def apply(
        self,
        values: torch.Tensor,
        slots: dict[str, torch.Tensor],
        rows: torch.Tensor,
        gradient: torch.Tensor,
        step: int,
    ) -> None:
        """Update ``values`` and ``slots`` (``[capacity, dim]`` tensors, in place) at ``rows``.

        ``rows``: unique int64 slot indices into ``values``; ``gradient``: one row per index,
        same dtype as ``values``; ``step``: the table's step count *including* this update
        (1 for the first), the ``step`` torch keeps in its optimizer state.
        """
        if rows.numel() == 0:
            return  # torch skips the arithmetic of an empty gradient too (the step still counts)
        h = self.hyperparameters
        if self.name == "sgd":
            _add_rows(values, rows, gradient, alpha=-h["lr"])
        elif self.name == "adagrad":
            # torch.optim.adagrad._single_tensor_adagrad, sparse branch.
            clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
            state_sum = slots["sum"]
            summed = _add_rows(state_sum, rows, gradient.pow(2))
            std_values = summed.sqrt_().add_(h["eps"])
            _add_rows(values, rows, gradient / std_values, alpha=-clr)
        else:
            # torch.optim._functional.sparse_adam.
            beta1, beta2 = h["betas"]
            exp_avg, exp_avg_sq = slots["exp_avg"], slots["exp_avg_sq"]
            old_exp_avg_values = exp_avg.index_select(0, rows)
            exp_avg_update_values = gradient.sub(old_exp_avg_values).mul_(1 - beta1)
            numer = _add_rows(exp_avg, rows, exp_avg_update_values, rows_now=old_exp_avg_values)
            old_exp_avg_sq_values = exp_avg_sq.index_select(0, rows)
            exp_avg_sq_update_values = gradient.pow(2).sub_(old_exp_avg_sq_values).mul_(1 - beta2)
            summed_sq = _add_rows(
                exp_avg_sq, rows, exp_avg_sq_update_values, rows_now=old_exp_avg_sq_values
            )
            denom = summed_sq.sqrt_().add_(h["eps"])
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = h["lr"] * math.sqrt(bias_correction2) / bias_correction1
            _add_rows(values, rows, -step_size * numer.div_(denom))


#: The dtypes whose rows :func:`_add_rows` updates by gather, add and copy back: for them
#: that is bit for bit torch's dense += sparse kernel (each element ``r + alpha * v`` once;
#: checked over random tables, rows and alphas, ``tests/unit/test_sparse_update_rules.py``),
#: in about half its time on the click model's rows (28 against 52 us for 341 random rows of
#: a 1M x 8 table). Half-precision dtypes round otherwise in that kernel: they keep it.
_GATHERED_DTYPES = (torch.float32, torch.float64)


def _add_rows(
    target: torch.Tensor,
    rows: torch.Tensor,
    update: torch.Tensor,
    alpha: float = 1.0,
    rows_now: torch.Tensor | None = None,
) -> torch.Tensor:
    """``target[rows] += alpha * update`` with torch's rounding (that of the dense += sparse
    kernel the torch optimizers use), ``rows`` unique; returns the updated rows
    (``[len(rows), ...]``, a tensor of their own, not a view of ``target``).

    ``rows_now``: ``target``'s rows as they are now, when the caller gathered them already:
    updated in place and returned (the caller gives them up)."""
    if target.dtype in _GATHERED_DTYPES:
        gathered = target.index_select(0, rows) if rows_now is None else rows_now
        if alpha == 1.0:
            gathered.add_(update)
        else:
            gathered.add_(update, alpha=alpha)
        target.index_copy_(0, rows, gathered)
        return gathered
    sparse = torch.sparse_coo_tensor(
        rows.unsqueeze(0), update, (target.shape[0], *target.shape[1:]), check_invariants=False
    )
    if alpha == 1.0:
        target.add_(sparse)
    else:
        target.add_(sparse, alpha=alpha)
    return target.index_select(0, rows)


def _is_neutral(key: str, value: Any) -> bool:
    """momentum=0, weight_decay=0, nesterov=False: a refused option set to "off"."""
    return not isinstance(value, (list, tuple)) and value in (0, 0.0, False)


def _check_numbers(name: str, hyper: dict[str, Any]) -> None:
    for key, value in hyper.items():
        numbers = value if isinstance(value, tuple) else (value,)
        if key == "betas" and (
            len(numbers) != 2 or not all(0.0 <= float(b) < 1.0 for b in numbers)
        ):
            raise SparseRuleError(
                f"rule {name!r}: betas must be two numbers in [0, 1), got {value!r}"
            )
        for number in numbers:
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise SparseRuleError(f"rule {name!r}: {key}={value!r} must be a number")
            if not math.isfinite(number) or number < 0:
                raise SparseRuleError(
                    f"rule {name!r}: {key}={value!r} must be a finite number >= 0"
                )
