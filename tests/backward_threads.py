"""Which threads run a module's backward: for the tests of replicas and stages whose backward
must run on autograd's own thread of the loss's device (parallel/autograd_threads.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from torch import nn


def record_backward_threads(modules: Iterable[nn.Module]) -> list[str]:
    """The names of the threads that run each module's backward, appended as it runs (a hook
    on every parameter's gradient)."""
    threads: list[str] = []
    for module in modules:
        for p in module.parameters():
            p.register_hook(lambda g: threads.append(threading.current_thread().name))
    return threads
