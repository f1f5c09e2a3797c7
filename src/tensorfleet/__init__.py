"""tensorfleet: distributed training of PyTorch models in the style of Distributed TensorFlow.

A cluster of tasks grouped in jobs (``ps``, ``worker``); one :class:`Server` per task;
variables on parameter-server shards; workers that train replicas of the model through a
:class:`TrainingSession`; a chief (worker 0) that initializes the variables and decides when
training is over. This module is the public API; everything else may change.
"""

from tensorfleet import optim
from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.cluster.resolver import ResolvedTask, resolve_task
from tensorfleet.cluster.spec import ClusterSpec, TaskId
from tensorfleet.errors import (
    AuthenticationError,
    ClusterConfigError,
    DatasetError,
    DeadlineExceeded,
    LaunchError,
    ProtocolError,
    RemoteError,
    TensorfleetError,
)
from tensorfleet.ps.placement import PlacementPlan, plan_placement
from tensorfleet.session.hooks import Hook, LoggingHook, StepResult, StopAtStep
from tensorfleet.session.server import Server, ServerConfig
from tensorfleet.session.training_session import TrainingSession
from tensorfleet.version import __version__
from tensorfleet.worker.client import ClientTimeouts

__all__ = [
    "AuthenticationError",
    "ClientTimeouts",
    "ClusterConfigError",
    "ClusterSpec",
    "DatasetError",
    "DeadlineExceeded",
    "DeviceSpec",
    "Hook",
    "LaunchError",
    "LoggingHook",
    "PlacementPlan",
    "ProtocolError",
    "RemoteError",
    "ResolvedTask",
    "Server",
    "ServerConfig",
    "StepResult",
    "StopAtStep",
    "TaskId",
    "TensorfleetError",
    "TrainingSession",
    "__version__",
    "optim",
    "plan_placement",
    "resolve_task",
]
