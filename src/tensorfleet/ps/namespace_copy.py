"""Copying one model namespace's state onto another's on a ps task, and retuning a model's
update rule: the two ps operations of population-based training
(:mod:`tensorfleet.patterns.pbt`).

Operations (request body -> reply body; a controller first says ``hello`` with
``namespace_control: true``, which opens no model), answered by the task's
:class:`~tensorfleet.ps.model_router.ModelRouter` for the models it holds:

=======================  ===========================================================================
``copy_model``           ``model`` (the target), ``source`` (another model on this task) -> the
                         target's variables, moving average and optimizer state (Adam's moments
                         and step counts, momentum buffers) become a copy of the source's; the
                         reply holds the source's ``source_version`` (its update count) and
                         ``source_global_step`` at the copy, and the target's own
                         ``version``/``global_step`` (which the copy leaves as they were: they
                         count the target's own updates)
``set_hyperparameters``  ``model``, ``hyperparameters`` (e.g. ``{"lr": 0.01, "weight_decay":
                         1e-4}``) -> the model's update rule takes them from its next update on,
                         keeping its optimizer state; the reply holds the rule's hyperparameters
=======================  ===========================================================================

**Atomic**: the ps task's loop is single-threaded and answers one request at a time, so a
push to the target is applied either before the copy (and then overwritten by it) or after
it (on top of the copied state): never on a half-copied state, and no reply ever carries
one. Both copies are taken before anything of the target changes, so a copy refused (other
variables, another rule) leaves the target as it was. The copy is per ps task: a model placed
on several ps tasks is copied by one request per task, and a caller that needs the whole
model copied at one version keeps the target's workers from pushing meanwhile (the PBT
driver copies between its rounds, while every member waits).

**Bit-exact**: values and optimizer tensors are copied, not recomputed: after the copy the
target's state equals the source's at ``source_version`` bit for bit, and the same gradient
pushed to both gives the same values.

What is not copied: the model's persistent buffers (:mod:`~tensorfleet.ps.buffer_bank`) and
embedding tables; a ``copy_model`` between models that hold tables is refused, naming them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tensorfleet.errors import ConfigError, NotInitialized, ProtocolError, RequestRefused
from tensorfleet.ps.model_namespace import check_model_name, label
from tensorfleet.ps.service import ParameterService, check_same_version
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.wire.service_socket import Request

#: The operations this module answers (the router hands them here, not to a model's service).
OPERATIONS = ("copy_model", "set_hyperparameters")

#: The field of a ``hello`` from a controller (no worker of any model): it opens no model.
CONTROL_HELLO = "namespace_control"


def answers(request: Request) -> bool:
    """Whether ``request`` is this module's: one of :data:`OPERATIONS`, or a controller's
    ``hello`` (which the channel needs before any other request, and which opens no model)."""
    return request.op in OPERATIONS or (
        request.op == "hello" and request.body.get(CONTROL_HELLO) is True
    )


def copy_model(source: ParameterService, target: ParameterService) -> dict[str, int]:
    """Make ``target``'s variables, moving average and optimizer state a copy of
    ``source``'s; return the versions of the copy (see the module docstring).

    RequestRefused when either has no variables yet, the two hold other variables or
    update rules, or either holds embedding tables."""
    source_name, target_name = source.config.model, target.config.model
    for service in (source, target):
        if not service.store.initialized:
            raise NotInitialized(
                f"{service.config.name}: {label(service.config.model)} has no variables yet: "
                "its chief has not created them; copy once both models are created"
            )
        if service.tables.stats():
            raise RequestRefused(
                f"{service.config.name}: {label(service.config.model)} holds embedding tables "
                f"({', '.join(sorted(service.tables.stats()))}), which copy_model does not copy"
            )
    if source is target:
        raise RequestRefused(f"copy_model: {label(source_name)} cannot be copied onto itself")
    difference = source.store.layout.describe_difference(target.store.layout)
    if difference is not None:
        raise RequestRefused(
            f"{target.config.name}: cannot copy {label(source_name)} onto {label(target_name)}: "
            f"their variables differ ({difference}); copy between members of one population "
            "(the same model)"
        )
    if source.store.rule.name != target.store.rule.name:
        raise RequestRefused(
            f"{target.config.name}: cannot copy {label(source_name)} (rule "
            f"{source.store.rule.name!r}) onto {label(target_name)} (rule "
            f"{target.store.rule.name!r}): the optimizer state of one rule does not fit another"
        )
    if source.store.has_moving_average != target.store.has_moving_average:
        raise RequestRefused(
            f"{target.config.name}: {label(source_name)} and {label(target_name)} differ in "
            "keeping a moving average (ema_decay): give every member the same discipline"
        )
    target.store.take_state_of(source.store)
    return {
        "source_version": source.store.version,
        "source_global_step": source.global_step,
        "version": target.store.version,
        "global_step": target.global_step,
    }


def retuned_rule(rule: UpdateRule, hyperparameters: object) -> UpdateRule:
    """``rule`` with ``hyperparameters`` (a map of some of its hyperparameters) changed,
    checked as a rule sent at ``create`` is; RequestRefused for a key the rule does not
    take or a value of the wrong type."""
    try:
        return rule.retuned(hyperparameters)
    except ConfigError as exc:
        raise RequestRefused(f"set_hyperparameters for rule {rule.name!r}: {exc}") from None


def set_hyperparameters(service: ParameterService, hyperparameters: object) -> dict[str, Any]:
    """Give ``service``'s update rule ``hyperparameters`` from its next update on (its
    optimizer state stays); return the rule's hyperparameters now."""
    if not service.store.initialized:
        raise NotInitialized(
            f"{service.config.name}: {label(service.config.model)} has no variables yet"
        )
    rule = retuned_rule(service.store.rule, hyperparameters)
    service.store.retune(rule)
    return rule.to_wire()["hyperparameters"]


def answer(models: Mapping[str, ParameterService], request: Request) -> dict[str, Any]:
    """The reply body of one of :data:`OPERATIONS` for the models a ps task holds (raises
    the refusal the router sends back)."""
    if request.op == "hello":
        check_same_version(request.body, "the controller", "this ps task")
        return {"models": sorted(models)}
    target = _model(models, request.body.get("model", ""), "model")
    if request.op == "copy_model":
        source = _model(models, request.body.get("source"), "source")
        return copy_model(source, target)
    return {"hyperparameters": set_hyperparameters(target, request.body.get("hyperparameters"))}


def _model(models: Mapping[str, ParameterService], name: object, field: str) -> ParameterService:
    try:
        check_model_name(name)
    except ValueError as exc:
        raise ProtocolError(f"'{field}': {exc}") from None
    service = models.get(name)  # type: ignore[arg-type]
    if service is None:
        raise NotInitialized(
            f"this ps task holds no {label(name)} ('{field}'); it holds "
            f"{', '.join(label(m) for m in sorted(models)) or 'no model'}"
        )
    return service
