"""How a ps combines the persistent buffers workers push (BatchNorm's running statistics and
any buffer a model registers with ``persistent=True``): one policy per buffer.

Buffers are model state, not trained by gradients: each worker updates its copy in the
forward pass (``running_mean``, ``running_var``, ``num_batches_tracked``), pushes it with its
step, and pulls back what the ps holds. The ps's value is what every checkpoint holds and
what the chief evaluates with. The policies:

* ``mean``: the mean of the values pushed for one step (sync mode's default for floating
  buffers). Each worker started the step from the same pulled value, so for BatchNorm's
  ``running_mean`` this is exactly what one process with the whole batch computes (the mean
  of equal slices' means is the whole batch's mean); for ``running_var`` it is the mean of
  the slices' variances, which misses the spread between the slices' means.
* ``latest``: the last value pushed wins (async mode's default for floating buffers): the
  buffer then follows the sequence of batches in the order the ps applied them, as the
  parameters do in async mode.
* ``running_mean``: ``current + rate * (pushed - current)``, pushed being the step's mean in
  sync mode; ``rate`` defaults to 1/num_workers, so in async mode every worker's view weighs
  about equally.
* ``max``: the largest value pushed (the default for integer buffers such as
  ``num_batches_tracked``: workers that pull it back all report the same count + 1).

The defaults can be overridden per buffer by name or by an ``fnmatch`` pattern
(``{"*.running_var": "latest"}``); an exact name wins over a pattern, and an override that
names no buffer is refused (a typo would otherwise be silently ignored). Non-persistent
buffers (``persistent=False``) are not model state: they stay local to each worker.
All functions here are pure: they return new tensors and change nothing.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tensorfleet.errors import TensorfleetError

KINDS = ("mean", "latest", "running_mean", "max")
MODES = ("sync", "async")


class BufferPolicyError(TensorfleetError, ValueError):
    """A buffer policy does not fit its buffer, its mode, or the values pushed."""


@dataclass(frozen=True)
class BufferPolicy:
    """``kind`` (mean|latest|running_mean|max); ``rate`` for running_mean (None: 1/workers)."""

    kind: str
    rate: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BufferPolicyError(f"buffer policy must be one of {KINDS}, got {self.kind!r}")
        if self.rate is not None and (self.kind != "running_mean" or not 0 < self.rate <= 1):
            raise BufferPolicyError(
                f"a rate (got {self.rate!r}) is for running_mean only, in (0, 1]"
            )


def default_policy(mode: str, dtype: torch.dtype) -> BufferPolicy:
    """``max`` for integer buffers; ``mean`` in sync mode and ``latest`` in async for the rest."""
    _check_mode(mode)
    if not (dtype.is_floating_point or dtype.is_complex):
        return BufferPolicy("max")
    return BufferPolicy("mean" if mode == "sync" else "latest")


def resolve_policies(
    buffers: Mapping[str, torch.dtype],
    mode: str,
    overrides: Mapping[str, str | BufferPolicy] | None = None,
) -> dict[str, BufferPolicy]:
    """The policy of each buffer (name -> dtype): the default, or an override by exact name
    or by ``fnmatch`` pattern (an exact name first, then the first pattern that matches)."""
    _check_mode(mode)
    parsed = {
        key: value if isinstance(value, BufferPolicy) else BufferPolicy(str(value))
        for key, value in (overrides or {}).items()
    }
    unused = [
        key for key in parsed if key not in buffers and not fnmatch.filter(list(buffers), key)
    ]
    if unused:
        raise BufferPolicyError(
            f"buffer policy override(s) {unused} name no buffer of the model; its persistent "
            f"buffers are {sorted(buffers)}"
        )
    policies = {}
    for name, dtype in buffers.items():
        policy = parsed.get(name)
        if policy is None:
            policy = next(
                (p for key, p in parsed.items() if fnmatch.fnmatchcase(name, key)),
                default_policy(mode, dtype),
            )
        _check_fits(name, dtype, policy, mode)
        policies[name] = policy
    return policies


def combine(
    name: str,
    policy: BufferPolicy,
    current: torch.Tensor,
    pushed: Sequence[torch.Tensor],
    num_workers: int,
) -> torch.Tensor:
    """The ps's new value of buffer ``name``: from its ``current`` value and the values
    ``pushed`` (one step's pushes in worker order in sync mode; one push in async mode)."""
    if not pushed:
        return current.clone()
    for value in pushed:
        if value.shape != current.shape or value.dtype != current.dtype:
            raise BufferPolicyError(
                f"buffer {name!r} is {current.dtype} {list(current.shape)} on the ps, a worker "
                f"pushed {value.dtype} {list(value.shape)}; fix: give every worker the same model"
            )
    if policy.kind == "latest":
        return pushed[-1].clone()
    if policy.kind == "max":
        return torch.stack(list(pushed)).amax(0)
    mean = pushed[0].clone() if len(pushed) == 1 else torch.stack(list(pushed)).mean(0)
    if policy.kind == "mean":
        return mean
    rate = policy.rate if policy.rate is not None else 1.0 / max(1, num_workers)
    return current + rate * (mean - current)


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of ``module`` that are model state (in its ``state_dict``), by the names
    ``state_dict`` uses; ``persistent=False`` buffers and ``None`` placeholders are left out."""
    keys = set(module.state_dict().keys())
    return {
        name: buffer
        for name, buffer in module.named_buffers()
        if buffer is not None and name in keys
    }


def _check_fits(name: str, dtype: torch.dtype, policy: BufferPolicy, mode: str) -> None:
    integer = not (dtype.is_floating_point or dtype.is_complex)
    if integer and policy.kind in ("mean", "running_mean"):
        raise BufferPolicyError(
            f"buffer {name!r} is {dtype}: policy {policy.kind!r} would average integers; fix: "
            f"use 'max' or 'latest' for it"
        )
    if mode == "async" and policy.kind == "mean":
        raise BufferPolicyError(
            f"buffer {name!r}: policy 'mean' averages one step's pushes, but in async mode each "
            f"push arrives alone; fix: use 'latest' or 'running_mean' in async mode"
        )


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise BufferPolicyError(f"buffer policies are for modes {MODES}, got {mode!r}")
