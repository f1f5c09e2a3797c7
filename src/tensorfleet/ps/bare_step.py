"""An optimizer step without torch's per-call wrappers, when nothing would see them.

**What.** :func:`bare_step` runs an optimizer's own ``step`` (the function its class
defines) under ``torch.no_grad()``, skipping the two wrappers torch puts around every
``Optimizer.step`` call: the profiling wrapper (a ``record_function`` range named
``Optimizer.step#SGD.step``, the global and per-optimizer step pre- and post-hooks) and the
gradient-mode wrapper (``torch.set_grad_enabled(differentiable)`` and three
``torch._dynamo.graph_break()`` calls around the step). Used where tensorfleet steps an
optimizer it built from an update rule: a ps shard's store (every push, every part of a
bucketed push), the one-process session and the all-reduce workers (every step).

**Why.** The wrappers' fixed cost is paid at every update. Measured with torch 2.13 on this
project's 2-vCPU machine, one 1,000-element float32 variable: ``SGD.step()`` 65.5 us wrapped
against 11.4 us bare, ``Adam(fused=True)`` 123.8 us against 55.8 us, ``Adagrad`` 140.5 us
against 74.3 us: 55-65 us per update, about a tenth of a ps's CPU per request for a small
model (``docs/wire-performance.md``, "The cost of a request, measured again") and of the
one-process click model's step (``benchmarks/sparse_tables.py --parts click``).

**Rule: bare only when nothing would see the difference.** The wrapped ``step()`` runs
instead when a profiler is recording (the step's range belongs in its trace), when any step
hook is registered (torch's global ones or the optimizer's own), when the optimizer was built
with ``differentiable=True`` (it needs gradients on), and for an optimizer class outside
``torch.optim`` (a rule the user registered, whose step may rely on the wrapper). The check
costs about 0.35 us.

**Invariant.** The arithmetic is the wrapped call's: the same function runs, with gradients
off as the wrapper turns them off for ``differentiable=False``; parameters and optimizer state
end bit for bit where ``step()`` puts them (``tests/unit/test_bare_step.py``, every built-in
rule and option; hooks and profiler ranges shown still to happen when present).

**The alternative**, calling torch's functional rules (``torch.optim.sgd.sgd``, ...) with
the state unpacked by hand, would skip the same wrappers and the per-step state lookups too,
but would copy every rule's bookkeeping (step counts, state initialisation, fused and foreach
choices) into this package, rule by rule; the bare step keeps torch's own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch.optim import optimizer as torch_optimizer


@functools.cache
def _own_step(optimizer_class: type) -> Callable[[torch.optim.Optimizer], object]:
    """The ``step`` function ``optimizer_class`` defines, under torch's wrappers (each made
    with ``functools.wraps``, so ``__wrapped__`` leads to it)."""
    return inspect.unwrap(optimizer_class.step)


def _observed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a wrapped ``step()`` would do something visible (see the module docstring)."""
    return bool(
        not type(optimizer).__module__.startswith("torch.optim.")
        or optimizer.defaults.get("differentiable", False)
        or optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
        or torch._C._autograd._profiler_enabled()
    )


def bare_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, without torch's profiling and gradient-mode wrappers when nothing
    would see them (see the module docstring): the class's own step under ``no_grad``."""
    if _observed(optimizer):
        optimizer.step()
        return
    with torch.no_grad():
        _own_step(type(optimizer))(optimizer)
