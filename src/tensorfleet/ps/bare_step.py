"""A ps shard's optimizer step without torch's per-call wrappers.

**What.** :func:`bare_step` runs an optimizer's own ``step`` (the function its class
defines) under ``torch.no_grad()``, skipping the two wrappers torch puts around every
``Optimizer.step`` call: the profiling wrapper (a ``record_function`` range named
``Optimizer.step#SGD.step``, the global and per-optimizer step pre- and post-hooks) and the
gradient-mode wrapper (``torch.set_grad_enabled(differentiable)`` and three
``torch._dynamo.graph_break()`` calls around the step).

**Why.** A ps applies one update per push, and per *part* of a push (a bucket of a worker's
gradients), so the wrappers' fixed cost is paid many times a step. Measured with torch 2.13
on this project's 2-vCPU machine, one 1,000-element float32 variable: ``SGD.step()`` 65.5 us
wrapped against 11.4 us bare, ``Adam(fused=True)`` 123.8 us against 55.8 us, ``Adagrad``
140.5 us against 74.3 us: 55-65 us per update of fixed cost, about a tenth of the ps's CPU
per request for a small model (``docs/wire-performance.md``, "The cost of a request").

**What is the same.** The arithmetic: the function that runs is the one the wrapped call
runs, with gradients off as the wrapper turns them off (``differentiable=False``, which no
built-in rule of the ps sets); parameters end bit for bit where ``step()`` puts them
(``tests/unit/test_bare_step.py``, every built-in rule). **What is lost**, on the ps only:
optimizer step hooks (the ps builds its optimizers itself; no user code registers hooks on
them) and the step's range in a ``torch.profiler`` trace of the ps process (the ps's own
spans in the step timeline are unaffected). Only torch's own optimizer classes (module
``torch.optim``) step bare: an optimizer of a rule registered by the user
(:func:`tensorfleet.ps.update_rules.register_update_rule`) may rely on its hooks or set up autograd
itself, and one built with ``differentiable=True`` needs gradients on; both get their
wrapped ``step()``, unchanged.

**The alternative**, calling torch's functional rules (``torch.optim.sgd.sgd``, ...) with the
state unpacked by hand, would skip the same wrappers and also the per-step state lookups,
but would copy every rule's bookkeeping (step counts, state initialisation, fused and
foreach choices) into this package for each rule; the bare step keeps torch's own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch


@functools.cache
def _own_step(optimizer_class: type) -> Callable[[torch.optim.Optimizer], object]:
    """The ``step`` function ``optimizer_class`` defines, under torch's wrappers (each made
    with ``functools.wraps``, so ``__wrapped__`` leads to it)."""
    return inspect.unwrap(optimizer_class.step)


def bare_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without the profiling and gradient-mode wrappers (see the module
    docstring): the class's own step under ``torch.no_grad()``."""
    if not type(optimizer).__module__.startswith("torch.optim.") or optimizer.defaults.get(
        "differentiable", False
    ):
        optimizer.step()
        return
    with torch.no_grad():
        _own_step(type(optimizer))(optimizer)
