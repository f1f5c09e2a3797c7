"""Which work a custom autograd Function's backward must run in its own thread.

In-graph replicas (:mod:`~tensorfleet.parallel.replicas`) and the pipeline behind a module
(:mod:`~tensorfleet.parallel.local_pipeline`) are autograd Functions whose ``backward`` runs
the replicas' or stages' own backward passes in threads of their own, so that devices
overlap. That is safe on the CPU, where autograd runs a backward on the thread that called
it. It is not safe on a GPU: there autograd runs every backward node of a device on *one*
thread of that device. The Function's ``backward`` is itself such a node, so it occupies its
device's thread while it waits; a replica or stage on the same device, its backward called
from another thread, is queued behind it and never runs. Measured on one H200 with two
replicas (or two stages) on ``/gpu:0``: the step hung until the test's deadline, 170 s.

So the Function runs the work of its own device in its own thread (autograd allows a
backward inside a backward on the same thread: it runs it at once, re-entrantly) and the
other devices' work in the pool as before. Work on the same GPU shares that GPU anyway, so
little overlap is lost: the kernels are asynchronous and the one thread queues them.

The alternative, the whole backward in the calling thread, would serialize replicas or stages
on different GPUs too; and running the Function's backward on the CPU (a CPU output) would
copy every gradient to the host and back.
"""

from __future__ import annotations

import torch


def backward_thread_device(grad: torch.Tensor) -> torch.device | None:
    """The device whose autograd thread runs a backward node receiving ``grad``: that
    device for an accelerator (CUDA, XPU, MPS, ...), None on the CPU (there the backward runs
    on the caller's thread, which no other backward waits for)."""
    return None if grad.device.type == "cpu" else grad.device


def same_device(device: torch.device, other: torch.device | None) -> bool:
    """Whether ``device`` is ``other`` (an index left out means the current one of its
    type, as torch reads it)."""
    if other is None or device.type != other.type:
        return False
    return _index(device) == _index(other)


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    if device.type == "cuda":
        return torch.cuda.current_device()
    return 0
