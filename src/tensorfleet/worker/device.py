"""From a device string to a ``torch.device`` this machine really has.

``/gpu:1``, ``/job:worker/task:0/device:gpu:0`` or ``/cpu:0`` name where a worker computes.
Asking for a GPU on a machine without one (or for an index past the last GPU) is an error
that says what was asked, what the machine has, and what to do, instead of a CUDA error deep
in the first forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.errors import ClusterConfigError


def torch_device(
    spec: str | DeviceSpec,
    cuda_device_count: Callable[[], int] | None = None,
) -> torch.device:
    """The ``torch.device`` for ``spec``; ClusterConfigError if the machine lacks it.

    ``cuda_device_count`` defaults to ``torch.cuda.device_count`` (tests pass their own)."""
    parsed = spec if isinstance(spec, DeviceSpec) else DeviceSpec.parse(spec)
    if parsed.device_type != "gpu":
        return torch.device("cpu")
    count = (cuda_device_count or _cuda_device_count)()
    index = parsed.device_index or 0
    if count == 0:
        raise ClusterConfigError(
            f"device {parsed.to_string()!r} asks for a GPU, but this machine has none that torch "
            f"can use (torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}). "
            "Use '/cpu:0', or run this task on a machine with a GPU and a CUDA build of torch"
        )
    if index >= count:
        raise ClusterConfigError(
            f"device {parsed.to_string()!r} asks for GPU {index}, but this machine has {count} "
            f"(indices 0..{count - 1}); pick one of those"
        )
    return torch.device(parsed.torch_device())


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
