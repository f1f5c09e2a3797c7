"""Errors of the parallel engines: misconfiguration, and a replica or stage that failed."""

from __future__ import annotations

from tensorfleet.errors import ConfigError, TensorfleetError


class ParallelConfigError(ConfigError):
    """A replica or pipeline set-up the engine cannot run: too many stages for the model's
    layers, a batch that does not split into the micro-batches, a device list that is empty."""


class ReplicaFailed(TensorfleetError, RuntimeError):
    """One in-graph replica raised during its forward or backward pass (chained)."""


class PipelineFailed(TensorfleetError, RuntimeError):
    """A pipeline stage failed, died or stopped answering; the message names the stage (and
    its task) and what the other stages were doing."""
