"""The session's update rule as a torch optimizer, so that torch's learning-rate schedulers
(and a hand-written schedule) drive it in every mode: ``TrainingSession.optimizer``.

What. A ``torch.optim.Optimizer`` with one parameter group that holds the rule's
hyperparameters (``lr``, ``momentum``, ``betas``, ``weight_decay`` ... with torch's defaults
for those the rule was not given), over a placeholder parameter of no elements: it trains
nothing itself. Before every step the session takes what changed in that group since the
rule was made, when that differs from what it applied last (:meth:`RuleOptimizer.due`),
and gives it to its updater, which applies it
where the rule runs: the optimizer of one process or of each all-reduce worker (its
parameter group), or the ps shards, with every push (:mod:`tensorfleet.ps.pushed_hyperparameters`).
The session calls :meth:`RuleOptimizer.step` once per step (it does nothing), so that a
scheduler attached to it counts steps as it counts a real optimizer's.

Why a stand-in and not the real optimizer: in the ps modes the optimizer lives on the
parameter servers, and in one process the session steps its optimizer with torch's wrappers
taken off (:mod:`tensorfleet.ps.bare_step`); one object that every mode reads the same way
keeps a training script the same in all of them, as ``tf.train`` schedules of the global step
did. The alternative, schedules declared in the rule and evaluated by the shards from the
global step, could not run torch's schedulers (``OneCycleLR``, ``ReduceLROnPlateau``, a
``LambdaLR`` of the user's) and would need the global step on shards that do not count it.

What it does not cover: the row-sparse rule of embedding tables (``sparse_optimizer``) and
the optimizers of in-graph replicas and pipeline stages keep their hyperparameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensorfleet.ps.update_rules import UpdateRule


class RuleOptimizer(torch.optim.Optimizer):
    """``rule``'s hyperparameters in one parameter group (``param_groups[0]``): change them
    there, or attach a torch learning-rate scheduler, and the session's next step applies
    them (see the module)."""

    def __init__(self, rule: UpdateRule) -> None:
        placeholder = torch.zeros(0, requires_grad=True)
        built = rule.build([placeholder])  # torch's defaults for what the rule leaves out
        names = rule.hyperparameter_names
        defaults = {k: v for k, v in built.param_groups[0].items() if k in names}
        super().__init__([placeholder], defaults)
        self.rule = rule
        self._initial = dict(defaults)
        self._applied = dict(rule.hyperparameters)
        # What torch's schedulers read to warn of a scheduler stepped before its optimizer
        # (the first value of its schedule would be skipped). Here the values are read at
        # each session step, whenever the scheduler moved them: a resumed run bringing its
        # schedule to where it was, before any step, skips nothing.
        self._opt_called = True

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Nothing: the session applies the rule. It calls this once per step."""
        return None

    def changes(self) -> dict[str, Any]:
        """The rule's hyperparameters (as given) with those changed in the parameter group
        since the rule was made; empty when nothing changed."""
        group = self.param_groups[0]
        changed = {
            key: _plain(group[key])
            for key, initial in self._initial.items()
            if key in group and _plain(group[key]) != _plain(initial)
        }
        return {**self.rule.hyperparameters, **changed} if changed else {}

    def due(self) -> dict[str, Any] | None:
        """The hyperparameters to apply from this step on, when they differ from those
        applied last (at first: the rule's); None when nothing is to change."""
        current = self.changes() or dict(self.rule.hyperparameters)
        if current == self._applied:
            return None
        self._applied = current
        return current


def _plain(value: Any) -> Any:
    """A hyperparameter as a number (a scheduler may hold a 0-d tensor), a pair as a tuple."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, list):
        return tuple(value)
    return value
