"""From a device string to a ``torch.device`` this machine really has, with soft placement.

``/gpu:1``, ``/job:worker/task:0/device:GPU:0`` or ``/cpu:0`` name where a worker computes.
Asking for a GPU this machine lacks (none at all, or an index past the last one) is, by
default, an error that names what was asked and the devices present, instead of a CUDA error
deep in the first forward pass. With soft placement (TensorFlow's
``allow_soft_placement``) it is one :class:`SoftPlacementWarning` per asked device and
process, and the CPU instead.

Every CPU index names the same ``torch.device("cpu")``: torch has one CPU device. Indices
still matter to tensorfleet as *logical* devices (two in-graph replicas on ``/cpu:0`` and
``/cpu:1`` run in two threads).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.errors import ClusterConfigError


class SoftPlacementWarning(UserWarning):
    """A GPU was asked for that this machine lacks, and soft placement put the work on the CPU."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def available_devices(cuda_device_count: Callable[[], int] | None = None) -> list[DeviceSpec]:
    """The devices torch can use here: ``/device:CPU:0``, then ``/device:GPU:i`` per GPU."""
    count = (cuda_device_count or cuda_device_count_here)()
    return [DeviceSpec(device_type="CPU", device_index=0)] + [
        DeviceSpec(device_type="GPU", device_index=i) for i in range(count)
    ]


def torch_device(
    spec: str | DeviceSpec,
    cuda_device_count: Callable[[], int] | None = None,
    *,
    soft_placement: bool = False,
) -> torch.device:
    """The ``torch.device`` for ``spec`` (only its device part counts: job and task say which
    process runs the code, not which device).

    A GPU the machine lacks raises :class:`ClusterConfigError` naming it and the devices
    present, or with ``soft_placement=True`` gives the CPU and warns once per device string.
    ``cuda_device_count`` defaults to torch's count (tests pass their own).
    """
    parsed = spec if isinstance(spec, DeviceSpec) else DeviceSpec.parse(spec)
    if parsed.device_type != "GPU":
        return torch.device("cpu")
    count = (cuda_device_count or cuda_device_count_here)()
    index = parsed.device_index or 0
    if index < count:
        return torch.device(parsed.torch_device())
    present = ", ".join(d.to_string() for d in available_devices(lambda: count))
    if count == 0:
        problem = (
            f"device {parsed.to_string()!r} asks for a GPU, but this machine has none that torch "
            f"can use (torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}; "
            f"devices present: {present})"
        )
    else:
        problem = (
            f"device {parsed.to_string()!r} asks for GPU {index}, but this machine has {count} "
            f"(devices present: {present})"
        )
    if not soft_placement:
        raise ClusterConfigError(
            f"{problem}. Pick one of those, run this task where the GPU is, or allow soft "
            "placement (soft_placement=True) to fall back to the CPU"
        )
    key = parsed.to_string()
    with _warned_lock:
        first = key not in _warned
        _warned.add(key)
    if first:
        warnings.warn(
            f"{problem}; soft placement: computing on /device:CPU:0 instead",
            SoftPlacementWarning,
            stacklevel=2,
        )
    return torch.device("cpu")


def cuda_device_count_here() -> int:
    """How many CUDA devices torch can use in this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
