"""The cluster layer: what the cluster looks like and which task this process is.

The lowest layer of tensorfleet: it imports nothing from the others except
:mod:`tensorfleet.errors` and :mod:`tensorfleet.environment`.

- :class:`ClusterSpec`, :class:`TaskId`, :class:`Address`: jobs, tasks and their addresses,
  with TensorFlow's ``tf.train.ClusterSpec`` API.
- :class:`DeviceSpec`: device strings such as ``/job:worker/task:1/device:gpu:0``.
- :func:`resolve_task`: this process's task, from arguments, flags, ``TF_CONFIG`` or Slurm.
- :func:`expand_hostlist`, :func:`expand_tasks_per_node`: Slurm's compressed notations.
"""

from __future__ import annotations

from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.cluster.resolver import (
    DETECTORS,
    ArgumentsDetector,
    FlagsDetector,
    ResolvedTask,
    ResolveRequest,
    SlurmDetector,
    TaskDetector,
    TFConfigDetector,
    load_cluster,
    resolve_task,
)
from tensorfleet.cluster.slurm import block_layout, expand_hostlist, expand_tasks_per_node
from tensorfleet.cluster.spec import Address, ClusterSpec, TaskId, parse_address

__all__ = [
    "DETECTORS",
    "Address",
    "ArgumentsDetector",
    "ClusterSpec",
    "DeviceSpec",
    "FlagsDetector",
    "ResolveRequest",
    "ResolvedTask",
    "SlurmDetector",
    "TFConfigDetector",
    "TaskDetector",
    "TaskId",
    "block_layout",
    "expand_hostlist",
    "expand_tasks_per_node",
    "load_cluster",
    "parse_address",
    "resolve_task",
]
