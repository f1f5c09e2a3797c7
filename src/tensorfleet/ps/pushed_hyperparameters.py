"""The hyperparameters a push carries: a worker's learning-rate schedule reaching the shard's
update rule.

What. A worker whose session's :attr:`~tensorfleet.TrainingSession.optimizer` was changed
(by a torch learning-rate scheduler, or by hand) sends the rule's hyperparameters with every
push from then on (``"hyperparameters": {"lr": 0.025, ...}``, the whole push and each
bucket). Before the shard applies the push it takes them (:func:`take_pushed`): the rule is
retuned from this update on, keeping its optimizer state, exactly as the session's own
optimizer in one process would be. A push without the field leaves the rule as it is.

Why per push, not a request of its own when the schedule changes: the values ride with the
gradients they apply to, so they reach every shard a step touches in the same order as its
gradients (a separate request could reach one shard after the push it was meant for), a ps
restarted from a checkpoint takes them again from the next push (a restored rule is the one
the chief created), and a schedule that changes at every step (cosine, one-cycle) costs a few
bytes per push instead of a request per shard per step. Each update is applied with the
hyperparameters of the push it comes from: in ``async`` mode a worker whose schedule lags
(another epoch count) moves the rule back for its own pushes, as each TensorFlow worker
computed its own learning rate from the global step it read; in ``sync`` mode a step's mean
is applied with the last contributor's, the same on every worker that steps its scheduler
alike.

The update log records the rule's hyperparameters with each update
(:mod:`tensorfleet.ps.update_log`), so a replay applies every update with the ones it was
applied with, bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorfleet.errors import ConfigError, RequestRefused

if TYPE_CHECKING:
    from tensorfleet.ps.store import VariableStore

#: The field of a push's body.
FIELD = "hyperparameters"


def take_pushed(store: VariableStore, body: dict[str, Any], shard: str) -> None:
    """Retune ``store``'s rule with the hyperparameters ``body`` carries, if any and if they
    differ from the rule's; RequestRefused (nothing applied) for a key the rule does not
    take or a value it refuses."""
    pushed = body.get(FIELD)
    if pushed is None or store.rule is None:
        return
    if isinstance(pushed, dict) and store.rule.hyperparameters == {
        key: tuple(value) if isinstance(value, list) else value for key, value in pushed.items()
    }:
        return  # the rule's already (every push of a schedule carries them): nothing to check
    try:
        rule = store.rule.retuned(pushed)
    except ConfigError as exc:
        raise RequestRefused(
            f"{shard}: the push's hyperparameters {pushed!r:.200} do not fit the update rule "
            f"{store.rule.name!r}: {exc}"
        ) from None
    if rule.hyperparameters != store.rule.hyperparameters:
        store.retune(rule)
