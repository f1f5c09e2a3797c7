"""Update rules: how a parameter server turns received gradients into new parameter values.

A rule is named data (:class:`UpdateRule`: a name and hyperparameters), never code: the
chief sends it to every shard in msgpack, and each shard builds the matching ``torch.optim``
optimizer over its own variables, so the semantics are exactly PyTorch's. The built-in rules
are SGD (with optional momentum / Nesterov), Adam and Adagrad; more can be registered with
:func:`register_update_rule` in a ps process that runs user code.

All built-in rules are elementwise, which is why partitioning a variable across shards and
fusing many variables into one buffer give the same result as one process, and why a shard
may step a big variable in cache-sized pieces (:mod:`tensorfleet.ps.optimizer_pieces`). A
registered rule says whether it is elementwise (``elementwise=True``); one that is not (a
rule that takes a norm over a whole tensor, as LARS does) steps whole variables.

**Kernels.** torch has two implementations of these rules on the CPU: its default, one
pass over memory per operation (Adam: ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, ``div_``,
``add_``, ``addcdiv_``), and a fused kernel that reads and writes each element once
(``fused=True``). **Adam and Adagrad use the fused kernel by default** wherever torch has it
for the variables' device and dtype (Adam: CPU and CUDA; Adagrad: CPU; float16, bfloat16,
float32, float64): :data:`FUSED_BY_DEFAULT`, :meth:`UpdateRule.uses_fused_kernel`. The
measured reason: on the lent GPU machine (one H200, 16 cores, 2026-11-27) a sampling profile
of 1 ps + 1 GPU worker training the CNN found the ps in torch's default Adam for 57 % of its
CPU samples, and on this project's 2-vCPU machine one Adam step of 1.6 M float32 parameters
took 3.75-4.36 ms with the default kernel stepped in cache-sized pieces
(:mod:`tensorfleet.ps.optimizer_pieces`) against 1.20-1.27 ms fused, 27 M parameters 73-140
ms against 22.5-25.5 ms (1 and 2 threads). That update is what a worker waits for every step.

The price is rounding: the fused kernel's results differ from the default kernel's in the last
bits (2.4e-7 at most after 200 Adam steps of the CNN, in 0.3 % of the elements). Every path of
this project builds its optimizers here, so a sync cluster still equals a tensorfleet
process bit for bit; against a plain PyTorch loop the rule by name equals
``torch.optim.Adam(params, fused=True)`` bit for bit. ``fused=False`` asks for torch's
default implementation (then ``torch.optim.Adam(params)`` bit for bit, and a shard steps big
variables in pieces); giving ``foreach`` also leaves the choice to torch. SGD keeps torch's
default (without momentum it is one pass already; ``fused=True`` is offered).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorfleet.errors import ConfigError

OptimizerFactory = Callable[[Sequence[torch.Tensor], dict[str, Any]], torch.optim.Optimizer]

#: The built-in rules stepped with torch's fused kernel when they leave ``fused`` (and
#: ``foreach``) unset, and the device types torch has that kernel for (module docstring).
FUSED_BY_DEFAULT: dict[str, frozenset[str]] = {
    "adam": frozenset({"cpu", "cuda"}),
    "adagrad": frozenset({"cpu"}),
}
#: The dtypes torch's fused kernels take.
FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclass(frozen=True)
class UpdateRule:
    """An update rule by name, with its hyperparameters (plain numbers and booleans)."""

    name: str
    hyperparameters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        spec = _RULES.get(self.name)
        if spec is None:
            raise ConfigError(f"unknown update rule {self.name!r}; known: {sorted(_RULES)}")
        spec.validate(self.hyperparameters)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack form sent to the parameter servers."""
        return {"name": self.name, "hyperparameters": dict(self.hyperparameters)}

    @classmethod
    def from_wire(cls, data: object) -> UpdateRule:
        """Parse a rule received from the network (ValueError if anything is off)."""
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("name"), str)
            or not isinstance(data.get("hyperparameters"), dict)
        ):
            raise ConfigError(
                f"an update rule is {{name: str, hyperparameters: map}}, got {data!r}"
            )
        hyper = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data["hyperparameters"].items()
        }
        return cls(data["name"], hyper)

    @property
    def hyperparameter_names(self) -> list[str]:
        """Every hyperparameter this rule takes (those it was given and the others)."""
        return sorted(_RULES[self.name].allowed)

    def retuned(self, changes: object) -> UpdateRule:
        """This rule with some of its hyperparameters changed (``changes``: a map of them,
        as it comes from the network: lists stand for tuples), checked as a new rule is:
        ConfigError for a key the rule does not take or a value of the wrong type."""
        if not isinstance(changes, dict) or not changes:
            raise ConfigError(
                f"hyperparameters to change must be a non-empty map of the rule's hyperparameters "
                f"(e.g. {{'lr': 0.01}}), got {changes!r:.200}"
            )
        changed = {k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()}
        return UpdateRule(self.name, {**self.hyperparameters, **changed})

    @property
    def elementwise(self) -> bool:
        """Whether each element's update depends only on that element (its value, gradient
        and state) and the step count: then the rule may step any slice of a variable."""
        return _RULES[self.name].elementwise

    def uses_fused_kernel(self, devices: Iterable[str], dtypes: Iterable[torch.dtype]) -> bool:
        """Whether :meth:`build` steps variables on these device types (``"cpu"``,
        ``"cuda"``) and of these dtypes with torch's fused kernel: when the rule asks for it
        (``fused=True``), or leaves ``fused`` and ``foreach`` unset and is one of
        :data:`FUSED_BY_DEFAULT` whose kernel exists for every device type and dtype given."""
        asked = self.hyperparameters.get("fused")
        if asked is not None:
            return bool(asked)
        supported = FUSED_BY_DEFAULT.get(self.name)
        if supported is None or "foreach" in self.hyperparameters:
            return False
        return all(device in supported for device in devices) and all(
            dtype in FUSED_DTYPES for dtype in dtypes
        )

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """The torch optimizer applying this rule to ``params`` (tensors updated in place),
        with the fused kernel where :meth:`uses_fused_kernel` says so.

        ValueError when torch refuses the hyperparameters."""
        hyper = dict(self.hyperparameters)
        if (
            params
            and "fused" not in hyper
            and self.uses_fused_kernel({p.device.type for p in params}, {p.dtype for p in params})
        ):
            hyper["fused"] = True
        try:
            return _RULES[self.name].factory(params, hyper)
        except (TypeError, IndexError, KeyError) as exc:
            # e.g. Adam(betas=(0.9,)) raises IndexError inside torch; a ps answers ValueError
            # with a refusal instead of letting it end the service loop.
            raise ConfigError(
                f"update rule {self.name!r} cannot be built with {self.hyperparameters}: "
                f"{type(exc).__name__}: {exc}"
            ) from None


@dataclass(frozen=True)
class _RuleSpec:
    factory: OptimizerFactory
    allowed: dict[str, tuple[type, ...]]
    elementwise: bool = False

    def validate(self, hyper: dict[str, Any]) -> None:
        for key, value in hyper.items():
            types = self.allowed.get(key)
            if types is None:
                raise ConfigError(
                    f"unknown hyperparameter {key!r}; allowed: {sorted(self.allowed)}"
                )
            if isinstance(value, bool) and bool not in types:
                raise ConfigError(f"hyperparameter {key}={value!r} must be a number")
            if isinstance(value, tuple):
                # Tuple hyperparameters (Adam's betas) are pairs of numbers.
                if (
                    tuple not in types
                    or len(value) != 2
                    or not all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
                    )
                ):
                    raise ConfigError(
                        f"hyperparameter {key}={value!r} has the wrong type: it must be a pair of numbers"
                    )
            elif isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"hyperparameter {key}={value!r} must be a finite number")
            elif not isinstance(value, types):
                raise ConfigError(
                    f"hyperparameter {key}={value!r} has the wrong type ({type(value).__name__})"
                )


_RULES: dict[str, _RuleSpec] = {}
_NUMBER = (int, float)


def register_update_rule(
    name: str,
    factory: OptimizerFactory,
    allowed: dict[str, tuple[type, ...]],
    elementwise: bool = False,
) -> None:
    """Make a rule available by ``name``. ``allowed`` maps each hyperparameter to its types.
    ``elementwise``: each element's update depends only on that element's value, gradient
    and state and on the step count (torch's SGD, Adam, Adagrad); a shard then steps big
    variables in cache-sized pieces (:mod:`tensorfleet.ps.optimizer_pieces`), bit for bit
    the same values. Leave it False for a rule that reads a whole tensor at once (a norm).

    The rule must exist in every ps process that may receive it (ps tasks that run only
    ``tensorfleet server`` know the built-in rules)."""
    _RULES[name] = _RuleSpec(factory, allowed, elementwise)


def _torch_factory(
    cls: type[torch.optim.Optimizer], defaults: dict[str, Any] | None = None
) -> OptimizerFactory:
    def factory(params: Sequence[torch.Tensor], hyper: dict[str, Any]) -> torch.optim.Optimizer:
        return cls(list(params), **{**(defaults or {}), **hyper})

    return factory


register_update_rule(
    "sgd",
    _torch_factory(torch.optim.SGD),
    {
        "lr": _NUMBER,
        "momentum": _NUMBER,
        "dampening": _NUMBER,
        "weight_decay": _NUMBER,
        "nesterov": (bool,),
        "foreach": (bool,),
        "fused": (bool,),
    },
    elementwise=True,
)
register_update_rule(
    "adam",
    _torch_factory(torch.optim.Adam),
    {
        "lr": _NUMBER,
        "betas": (tuple,),
        "eps": _NUMBER,
        "weight_decay": _NUMBER,
        "amsgrad": (bool,),
        "foreach": (bool,),
        "fused": (bool,),
    },
    elementwise=True,
)
register_update_rule(
    "adagrad",
    _torch_factory(torch.optim.Adagrad),
    {
        "lr": _NUMBER,
        "lr_decay": _NUMBER,
        "weight_decay": _NUMBER,
        "initial_accumulator_value": _NUMBER,
        "eps": _NUMBER,
        "foreach": (bool,),
        "fused": (bool,),
    },
    elementwise=True,
)


def _fused(fused: bool | None) -> dict[str, Any]:
    """The ``fused`` hyperparameter as given (absent for None: :meth:`UpdateRule.build`
    chooses)."""
    return {} if fused is None else {"fused": fused}


def SGD(
    lr: float = 0.01,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    fused: bool = False,
) -> UpdateRule:
    """Plain SGD (``torch.optim.SGD``); with ``momentum`` > 0 it is momentum SGD.
    ``fused``: torch's fused kernel (see the module docstring)."""
    return UpdateRule(
        "sgd",
        {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            **_fused(fused or None),
        },
    )


def Momentum(
    lr: float = 0.01, momentum: float = 0.9, nesterov: bool = False, fused: bool = False
) -> UpdateRule:
    """SGD with momentum (TensorFlow's MomentumOptimizer), ``torch.optim.SGD`` semantics."""
    return SGD(lr=lr, momentum=momentum, nesterov=nesterov, fused=fused)


def Adam(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    fused: bool | None = None,
) -> UpdateRule:
    """Adam (``torch.optim.Adam``). ``fused``: None (the default) steps with torch's fused
    kernel wherever torch has it for the variables (one pass over memory: 3-6x faster on the
    CPU), True always (torch refuses devices without it), False with torch's default
    implementation, ``torch.optim.Adam(params)`` bit for bit (module docstring, "Kernels")."""
    return UpdateRule(
        "adam",
        {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            **_fused(fused),
        },
    )


def Adagrad(
    lr: float = 0.01,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    fused: bool | None = None,
) -> UpdateRule:
    """Adagrad (``torch.optim.Adagrad``). ``fused``: None (the default) steps with torch's
    fused kernel where torch has it (CPU variables), True always, False with torch's default
    implementation (module docstring, "Kernels")."""
    return UpdateRule(
        "adagrad",
        {
            "lr": lr,
            "initial_accumulator_value": initial_accumulator_value,
            "eps": eps,
            **_fused(fused),
        },
    )


def warm_up_optimizers() -> None:
    """Build one throwaway torch optimizer, so that the first ``create`` a ps answers is not
    held behind torch's lazy imports: the first ``torch.optim`` optimizer of a process
    imports ``torch._dynamo``, measured at 3-8 s on this project's 2-vCPU machine, which is
    longer than a short ``create`` deadline."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def rule_label(rule: object) -> str:
    """A rule as an error message names it: its kind and name (``UpdateRule 'adam'``,
    ``SparseRowRule 'adagrad'``), or the type of anything else (``None`` for None)."""
    if rule is None:
        return "None"
    name = getattr(rule, "name", None)
    return f"{type(rule).__name__} {name!r}" if isinstance(name, str) else repr(type(rule).__name__)
