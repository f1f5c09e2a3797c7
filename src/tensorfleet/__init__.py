"""tensorfleet: distributed training of PyTorch models in the style of Distributed TensorFlow.

A cluster of tasks grouped in jobs (``ps``, ``worker``); one :class:`Server` per task;
variables on parameter-server shards; workers that train replicas of the model through a
:class:`TrainingSession`; a chief (worker 0) that initializes the variables and decides when
training is over. This module is the public API; everything else may change.

Names are imported on first use, so that ``tensorfleet launch`` and ``tensorfleet server``
start without loading every layer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tensorfleet.version import __version__

#: Public name -> module that defines it.
_EXPORTS = {
    "ClusterSpec": "tensorfleet.cluster.spec",
    "TaskId": "tensorfleet.cluster.spec",
    "DeviceSpec": "tensorfleet.cluster.device",
    "ResolvedTask": "tensorfleet.cluster.resolved_task",
    "resolve_task": "tensorfleet.cluster.resolver",
    "AuthenticationError": "tensorfleet.errors",
    "ConfigError": "tensorfleet.errors",
    "ConfigTypeError": "tensorfleet.errors",
    "UsageError": "tensorfleet.errors",
    "ListenError": "tensorfleet.errors",
    "CheckpointMismatch": "tensorfleet.errors",
    "IdentityInUse": "tensorfleet.errors",
    "NotInitialized": "tensorfleet.errors",
    "WorkerLost": "tensorfleet.errors",
    "RequestRefused": "tensorfleet.errors",
    "RemoteProtocolError": "tensorfleet.errors",
    "RemoteDeadlineExceeded": "tensorfleet.errors",
    "EncryptionMismatch": "tensorfleet.errors",
    "LaunchConfigError": "tensorfleet.errors",
    "CheckpointError": "tensorfleet.errors",
    "ConnectionLost": "tensorfleet.errors",
    "Preempted": "tensorfleet.errors",
    "NonFiniteError": "tensorfleet.errors",
    "ServiceRestarted": "tensorfleet.errors",
    "PayloadStreamLost": "tensorfleet.errors",
    "ClusterConfigError": "tensorfleet.errors",
    "DatasetError": "tensorfleet.errors",
    "DeadlineExceeded": "tensorfleet.errors",
    "LaunchError": "tensorfleet.errors",
    "ProtocolError": "tensorfleet.errors",
    "RemoteError": "tensorfleet.errors",
    "TensorfleetError": "tensorfleet.errors",
    "PlacementPlan": "tensorfleet.ps.placement",
    "plan_placement": "tensorfleet.ps.placement",
    "CheckpointHook": "tensorfleet.session.hooks",
    "NanGuard": "tensorfleet.session.hooks",
    "export_checkpoint": "tensorfleet.session.checkpoints",
    "load_checkpoint": "tensorfleet.session.checkpoints",
    "load_table_rows": "tensorfleet.session.checkpoints",
    "checkpoints_iterator": "tensorfleet.session.checkpoint_watch",
    "Hook": "tensorfleet.session.hooks",
    "LoggingHook": "tensorfleet.session.hooks",
    "StepResult": "tensorfleet.session.hooks",
    "StopAtStep": "tensorfleet.session.hooks",
    "ProgressHook": "tensorfleet.session.progress_hook",
    "Server": "tensorfleet.session.server",
    "ServerConfig": "tensorfleet.session.server",
    "SummaryHook": "tensorfleet.session.summary_hook",
    "TrainingSession": "tensorfleet.session.training_session",
    "plot_metrics": "tensorfleet.summaries.plot",
    "SummaryWriter": "tensorfleet.summaries.summary_writer",
    "ClientTimeouts": "tensorfleet.worker.timeouts",
    "ComputeOptions": "tensorfleet.worker.compute_options",
    "Overlap": "tensorfleet.worker.push_overlap",
    "EmbeddingTable": "tensorfleet.worker.embedding_table",
    "LocalRowSource": "tensorfleet.worker.local_row_source",
    "RowInitializer": "tensorfleet.ps.row_initializer",
    "AdmissionFilter": "tensorfleet.ps.admission_filter",
    "CpuSyncBatchNorm": "tensorfleet.worker.sync_batch_norm",
    "convert_sync_batchnorm": "tensorfleet.worker.sync_batch_norm",
    "UnsynchronizedBatchNormWarning": "tensorfleet.worker.sync_batch_norm",
    "torch_device": "tensorfleet.worker.device",
    "SoftPlacementWarning": "tensorfleet.worker.device",
    "device": "tensorfleet.worker.device_scope",
    "place": "tensorfleet.worker.device_scope",
    "placement_report": "tensorfleet.worker.placement_report",
    "TaskResources": "tensorfleet.cluster.resources",
    "plan_resources": "tensorfleet.cluster.resources",
    "apply_task_resources": "tensorfleet.worker.task_resources",
    "InGraphReplicas": "tensorfleet.parallel.replicas",
    "LocalPipeline": "tensorfleet.parallel.local_pipeline",
    "RemotePipelineStage": "tensorfleet.parallel.remote_pipeline",
    "join_process_group": "tensorfleet.parallel.remote_pipeline",
    "split_stages": "tensorfleet.parallel.stages",
    "serve_pipeline_stage": "tensorfleet.parallel.pipeline_updater",
    "pipeline_stage_of": "tensorfleet.parallel.pipeline_updater",
    "ParallelConfigError": "tensorfleet.parallel.errors",
    "TableNotAttached": "tensorfleet.worker.embedding_table",
    "SparseRuleError": "tensorfleet.ps.sparse_update_rules",
    "SparseGradientError": "tensorfleet.ps.sparse_rows",
    "PipelineFailed": "tensorfleet.parallel.errors",
    "ReplicaFailed": "tensorfleet.parallel.errors",
}
_SUBMODULES = {"optim"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])

if TYPE_CHECKING:
    from tensorfleet import optim
    from tensorfleet.cluster.device import DeviceSpec
    from tensorfleet.cluster.resolved_task import ResolvedTask
    from tensorfleet.cluster.resolver import resolve_task
    from tensorfleet.cluster.resources import TaskResources, plan_resources
    from tensorfleet.cluster.spec import ClusterSpec, TaskId
    from tensorfleet.errors import (
        AuthenticationError,
        CheckpointError,
        CheckpointMismatch,
        ClusterConfigError,
        ConfigError,
        ConfigTypeError,
        ConnectionLost,
        DatasetError,
        DeadlineExceeded,
        EncryptionMismatch,
        IdentityInUse,
        LaunchConfigError,
        LaunchError,
        ListenError,
        NonFiniteError,
        NotInitialized,
        PayloadStreamLost,
        Preempted,
        ProtocolError,
        RemoteDeadlineExceeded,
        RemoteError,
        RemoteProtocolError,
        RequestRefused,
        ServiceRestarted,
        TensorfleetError,
        UsageError,
        WorkerLost,
    )
    from tensorfleet.parallel.errors import ParallelConfigError, PipelineFailed, ReplicaFailed
    from tensorfleet.parallel.local_pipeline import LocalPipeline
    from tensorfleet.parallel.pipeline_updater import pipeline_stage_of, serve_pipeline_stage
    from tensorfleet.parallel.remote_pipeline import RemotePipelineStage, join_process_group
    from tensorfleet.parallel.replicas import InGraphReplicas
    from tensorfleet.parallel.stages import split_stages
    from tensorfleet.ps.admission_filter import AdmissionFilter
    from tensorfleet.ps.placement import PlacementPlan, plan_placement
    from tensorfleet.ps.row_initializer import RowInitializer
    from tensorfleet.ps.sparse_rows import SparseGradientError
    from tensorfleet.ps.sparse_update_rules import SparseRuleError
    from tensorfleet.session.checkpoint_watch import checkpoints_iterator
    from tensorfleet.session.checkpoints import (
        export_checkpoint,
        load_checkpoint,
        load_table_rows,
    )
    from tensorfleet.session.hooks import (
        CheckpointHook,
        Hook,
        LoggingHook,
        NanGuard,
        StepResult,
        StopAtStep,
    )
    from tensorfleet.session.progress_hook import ProgressHook
    from tensorfleet.session.server import Server, ServerConfig
    from tensorfleet.session.summary_hook import SummaryHook
    from tensorfleet.session.training_session import TrainingSession
    from tensorfleet.summaries.plot import plot_metrics
    from tensorfleet.summaries.summary_writer import SummaryWriter
    from tensorfleet.worker.compute_options import ComputeOptions
    from tensorfleet.worker.device import SoftPlacementWarning, torch_device
    from tensorfleet.worker.device_scope import device, place
    from tensorfleet.worker.embedding_table import EmbeddingTable, TableNotAttached
    from tensorfleet.worker.local_row_source import LocalRowSource
    from tensorfleet.worker.placement_report import placement_report
    from tensorfleet.worker.push_overlap import Overlap
    from tensorfleet.worker.sync_batch_norm import (
        CpuSyncBatchNorm,
        UnsynchronizedBatchNormWarning,
        convert_sync_batchnorm,
    )
    from tensorfleet.worker.task_resources import apply_task_resources
    from tensorfleet.worker.timeouts import ClientTimeouts


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"tensorfleet.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorfleet' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
