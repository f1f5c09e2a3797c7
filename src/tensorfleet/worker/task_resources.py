"""Apply a task's resources (:class:`~tensorfleet.cluster.resources.TaskResources`) to torch.

Called inside each task, early: by :class:`~tensorfleet.session.server.Server` with what the
launcher put in the environment, or by a user program with its own values. Order matters to
torch: the inter-op pool size can only be set before the first inter-op work starts, so a
process that already ran some keeps its size; that is reported as a warning naming both
numbers (not an error: the intra-op budget, which is what oversubscription is about, is
applied anyway). ``CUDA_VISIBLE_DEVICES`` is read by CUDA when it initializes, so the
launcher sets it in the task's environment; here it is only checked against what torch sees.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from tensorfleet.cluster.resources import TaskResources
from tensorfleet.errors import ClusterConfigError


@dataclass(frozen=True)
class AppliedResources:
    """What torch uses after :func:`apply_task_resources`, read back from torch itself."""

    intra_op_threads: int
    inter_op_threads: int
    cuda_devices: int
    gpu_memory_fraction: float | None


def apply_task_resources(resources: TaskResources | None = None) -> AppliedResources:
    """Set torch's thread pools and GPU memory cap from ``resources`` (default: what the
    launcher set in this process's environment). Unset parts are left as they are.

    Raises :class:`ClusterConfigError` if a memory fraction is asked for without a GPU."""
    res = TaskResources.from_env() if resources is None else resources
    if res.intra_op_threads is not None and torch.get_num_threads() != res.intra_op_threads:
        torch.set_num_threads(res.intra_op_threads)
    if res.inter_op_threads is not None and torch.get_num_interop_threads() != res.inter_op_threads:
        try:
            torch.set_num_interop_threads(res.inter_op_threads)
        except RuntimeError:
            warnings.warn(
                f"cannot set torch's inter-op threads to {res.inter_op_threads}: this process "
                f"already started inter-op work with {torch.get_num_interop_threads()}; apply "
                "the task resources before any torch work (tfl.Server does it on creation)",
                RuntimeWarning,
                stacklevel=2,
            )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if res.gpu_memory_fraction is not None:
        if count == 0:
            raise ClusterConfigError(
                f"gpu_memory_fraction={res.gpu_memory_fraction} asks to cap GPU memory, but this "
                "process sees no GPU; drop the fraction or give the task a GPU"
            )
        for index in range(count):  # pragma: no cover - needs a GPU
            torch.cuda.set_per_process_memory_fraction(res.gpu_memory_fraction, index)
    return AppliedResources(
        intra_op_threads=torch.get_num_threads(),
        inter_op_threads=torch.get_num_interop_threads(),
        cuda_devices=count,
        gpu_memory_fraction=res.gpu_memory_fraction,
    )
