"""Placing modules on devices: ``tfl.device(...)`` scopes and ``tfl.place(module, ...)``.

Two forms, because PyTorch code builds models two ways:

- ``with tfl.device("/gpu:0"):`` around the code that *builds* modules, as in TensorFlow.
  Scopes nest and merge field by field (an inner ``/job:ps`` keeps the outer device); inside,
  torch's own device context makes every parameter and buffer be created on the resolved
  device (no copy), and every module that registers a parameter is tagged with the merged
  spec for the placement report;
- ``tfl.place(module, "/gpu:0")`` for a module built elsewhere (a library or pretrained
  model, or a pipeline stage): it is moved there (merged with the enclosing scope) and
  tagged. This is PyTorch's idiom (``module.to(device)``) with tensorfleet's strings,
  checks and report.

A module computes in the process that runs it: a spec naming a job or task is checked against
this process's task (``task=`` or the task that ``TF_CONFIG``/Slurm give) and is an error
when it names another one, rather than being silently ignored. To run parts of a model on
other tasks, split it into pipeline stages (:mod:`tensorfleet.parallel`).

Soft placement (TensorFlow's ``allow_soft_placement``): off by default, so a missing GPU is
an error naming it and the devices present; with ``soft_placement=True`` it is the CPU and
one :class:`~tensorfleet.worker.device.SoftPlacementWarning` per device string.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.cluster.resolver import resolve_task, resolved_in_this_process
from tensorfleet.cluster.spec import TaskId
from tensorfleet.errors import ClusterConfigError
from tensorfleet.worker.device import torch_device

#: Attribute set on a module placed by a scope or :func:`place`: the merged DeviceSpec asked for.
PLACEMENT_ATTR = "_tensorfleet_device"

_M = TypeVar("_M", bound=nn.Module)
_state = threading.local()
_hook_lock = threading.Lock()
_hook_users = 0
_hook_handle: object | None = None


def current_device_spec() -> DeviceSpec:
    """The merged spec of this thread's enclosing ``tfl.device`` scopes (empty outside any)."""
    stack: list[tuple[DeviceSpec, TaskId | None]] = getattr(_state, "stack", [])
    return stack[-1][0] if stack else DeviceSpec()


def _scope_task(task: TaskId | str | None) -> TaskId | str | None:
    """``task`` if given, else the task an enclosing scope was checked against."""
    stack: list[tuple[DeviceSpec, TaskId | None]] = getattr(_state, "stack", [])
    return task if task is not None or not stack else stack[-1][1]


@contextmanager
def device(
    spec: str | DeviceSpec,
    *,
    soft_placement: bool = False,
    task: TaskId | str | None = None,
    cuda_device_count: Callable[[], int] | None = None,
) -> Iterator[torch.device]:
    """Build modules on ``spec`` (merged with the enclosing scope); yields the torch device.

    Raises :class:`ClusterConfigError` for a malformed string, a GPU this machine lacks
    (unless ``soft_placement``), or a job/task other than this process's. ``task`` is this
    process's task (default: from ``TF_CONFIG`` or Slurm, needed only when a spec names one).
    """
    merged = current_device_spec().merge(spec)
    checked = _check_task(merged, _scope_task(task))
    resolved = torch_device(merged, cuda_device_count, soft_placement=soft_placement)
    stack: list[tuple[DeviceSpec, TaskId | None]] = getattr(_state, "stack", None) or []
    _state.stack = stack
    stack.append((merged, checked))
    _install_tagging_hook()
    try:
        with resolved:
            yield resolved
    finally:
        stack.pop()
        _remove_tagging_hook()


def place(
    module: _M,
    spec: str | DeviceSpec,
    *,
    soft_placement: bool = False,
    task: TaskId | str | None = None,
    cuda_device_count: Callable[[], int] | None = None,
) -> _M:
    """Move ``module`` to ``spec`` (merged with the enclosing scope), tag it for the placement
    report, and return it. Same checks as :func:`device`."""
    merged = current_device_spec().merge(spec)
    _check_task(merged, _scope_task(task))
    resolved = torch_device(merged, cuda_device_count, soft_placement=soft_placement)
    module.to(resolved)
    for sub in module.modules():
        object.__setattr__(sub, PLACEMENT_ATTR, merged)
    return module


def requested_device(module: nn.Module) -> DeviceSpec | None:
    """The spec a scope or :func:`place` asked for ``module`` (None: never placed)."""
    return getattr(module, PLACEMENT_ATTR, None)


def _check_task(spec: DeviceSpec, task: TaskId | str | None) -> TaskId | None:
    """This process's task once checked against ``spec`` (None: the spec names no task)."""
    if not spec.names_task:
        return None
    if spec.replica not in (None, 0):
        raise ClusterConfigError(
            f"device {spec.to_string()!r} names replica {spec.replica}; tensorfleet tasks are "
            "all replica 0 (between-graph replication): drop the '/replica:' part"
        )
    if spec.job is None and spec.task is None:
        return None
    here = _local_task(task, spec)
    if (spec.job is not None and spec.job != here.job) or (
        spec.task is not None and spec.task != here.index
    ):
        to_ps = (
            " Variables go to the ps shards without a device: TrainingSession's placement= "
            "('greedy' or 'round_robin') and partition_threshold_bytes= place them, as "
            "replica_device_setter did."
            if spec.job == "ps"
            else ""
        )
        raise ClusterConfigError(
            f"device {spec.to_string()!r} names another task than this process's ({here}): a "
            "module computes in the process that builds it. Build it in that task's program, "
            "split the model into pipeline stages (tensorfleet.parallel), or drop the "
            f"'/job:'/'/task:' part.{to_ps}"
        )
    return here


def _local_task(task: TaskId | str | None, spec: DeviceSpec) -> TaskId:
    if isinstance(task, TaskId):
        return task
    if isinstance(task, str):
        return TaskId.parse(task)
    # The task resolve_task() found for this process (its flags too), else its environment.
    resolved = resolved_in_this_process() or resolve_task(argv=[], allow_none=True)
    if resolved is None:
        raise ClusterConfigError(
            f"device {spec.to_string()!r} names a job or task, but this process's task is "
            "unknown (no resolve_task() yet, no TF_CONFIG or Slurm environment): call "
            "tfl.resolve_task() first, pass task='JOB:INDEX' (this process's task, e.g. "
            "task='worker:1'), or drop the '/job:'/'/task:' part"
        )
    return TaskId(resolved.job, resolved.index)


def _tag(module: nn.Module, name: str, param: object) -> None:
    stack = getattr(_state, "stack", None)
    if stack:  # only modules built by this thread inside a scope
        object.__setattr__(module, PLACEMENT_ATTR, stack[-1][0])


def _install_tagging_hook() -> None:
    global _hook_users, _hook_handle
    with _hook_lock:
        _hook_users += 1
        if _hook_handle is None:
            _hook_handle = nn.modules.module.register_module_parameter_registration_hook(_tag)


def _remove_tagging_hook() -> None:
    global _hook_users, _hook_handle
    with _hook_lock:
        _hook_users -= 1
        if _hook_users == 0 and _hook_handle is not None:
            _hook_handle.remove()  # type: ignore[attr-defined]
            _hook_handle = None
