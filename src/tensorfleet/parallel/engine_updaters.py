"""In-graph replication and pipelines inside a task, plugged into a training session.

Both change how a step's gradients are *computed*, not how they become updated parameters,
so each is a decorator around the mode's own updater (async, sync, one process): the mode
keeps its exact meaning, and the model the step closure calls is replaced by the engine:

- :class:`ReplicaUpdater` (``TrainingSession(replica_devices=["/cpu:0", "/cpu:1"])``):
  ``sess.model`` is a :class:`~tensorfleet.parallel.replicas.ReplicatedModule`; the closure's
  ``loss.backward()`` leaves the whole batch's gradients in the model, pushed once per step;
- :class:`LocalPipelineUpdater` (``TrainingSession(stage_devices=["/gpu:0", "/gpu:1"],
  microbatches=4)``): ``sess.model`` is a
  :class:`~tensorfleet.parallel.local_pipeline.PipelinedModule` (GPipe: the closure computes
  the loss after the whole forward).

``allreduce`` mode is refused with either: its gradients are averaged by DDP hooks during
the backward of the model it wraps, which these engines do not run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.parallel.errors import ParallelConfigError
from tensorfleet.parallel.local_pipeline import LocalPipeline, PipelinedModule
from tensorfleet.parallel.replicas import InGraphReplicas, ReplicatedModule
from tensorfleet.parallel.stages import split_stages
from tensorfleet.worker.progress import Agreement
from tensorfleet.worker.timeline import NO_TIMELINE, Timeline


class _Decorator:
    """Everything but ``wrap`` and ``close`` is the inner updater's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.discipline = getattr(inner, "discipline", None)
        self.collective = getattr(inner, "collective", False)

    def connect(self, device: torch.device | None = None) -> None:
        self.inner.connect(device)

    def register(self, named_params: Any, rule: Any) -> None:
        self.inner.register(named_params, rule)

    def restore(self, checkpoints: Any, resume: bool = True) -> Any:
        return self.inner.restore(checkpoints, resume)

    def pull(self) -> Any:
        return self.inner.pull()

    def exchange(self, step: int, data: Any) -> Any:
        return self.inner.exchange(step, data)

    def retune(self, hyperparameters: dict[str, Any]) -> None:
        self.inner.retune(hyperparameters)

    def skip(self, step: int) -> Any:
        return self.inner.skip(step)

    def agree(self, stop: bool, checkpoint: bool = False, preempted: bool = False) -> Agreement:
        return self.inner.agree(stop, checkpoint, preempted)

    def save(self, data: Any = None, tables_since: Any = None) -> Any:
        return self.inner.save(data, tables_since)

    def finish(self, before_done: Callable[[], object] | None, failed: bool = False) -> None:
        self.inner.finish(before_done, failed)

    def leave(self) -> None:
        self.inner.leave()

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> list[dict[str, Any]]:
        return self.inner.stats()

    def moving_average(self) -> dict[str, torch.Tensor]:
        return self.inner.moving_average()


class ReplicaUpdater(_Decorator):
    """The mode's updater, with the model replicated on ``devices`` inside this task."""

    def __init__(
        self, inner: Any, devices: Sequence[str | DeviceSpec], *, soft_placement: bool = False
    ) -> None:
        super().__init__(inner)
        if len(devices) < 1:
            raise ParallelConfigError(
                "replica_devices needs at least one device, e.g. ['/cpu:0', '/cpu:1']"
            )
        self.devices = list(devices)
        self.soft_placement = soft_placement
        self.engine: InGraphReplicas | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self.engine = InGraphReplicas(model, self.devices, soft_placement=self.soft_placement)
        return self.inner.wrap(ReplicatedModule(self.engine))

    def placement(self) -> dict[str, Any]:
        """What the placement report shows of this engine: the replicas' devices."""
        if self.engine is None:
            return {}
        return {"replica_devices": [s.to_string() for s in self.engine.specs]}

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.engine is not None:
                self.engine.close()


class LocalPipelineUpdater(_Decorator):
    """The mode's updater, with the model split into stages on ``devices`` inside this task."""

    def __init__(
        self,
        inner: Any,
        devices: Sequence[str | DeviceSpec],
        n_microbatches: int,
        *,
        soft_placement: bool = False,
    ) -> None:
        super().__init__(inner)
        if len(devices) < 2:
            raise ParallelConfigError(
                f"stage_devices needs one device per stage, at least 2; got {list(devices)}"
            )
        self.devices = list(devices)
        self.n_microbatches = n_microbatches
        self.soft_placement = soft_placement
        self.pipeline: LocalPipeline | None = None
        self._timeline: Timeline = NO_TIMELINE

    def trace(self, timeline: Timeline) -> None:
        """Record the stages' forwards and backwards and each step's bubble in ``timeline``
        (:class:`~tensorfleet.parallel.local_pipeline.LocalPipeline`), and the inner mode's
        exchange when it shows one."""
        self._timeline = timeline
        if self.pipeline is not None:
            self.pipeline.timeline = timeline
        if hasattr(self.inner, "trace"):
            self.inner.trace(timeline)

    def wrap(self, model: nn.Module) -> nn.Module:
        stages = split_stages(model, len(self.devices))  # type: ignore[arg-type]
        self.pipeline = LocalPipeline(
            stages,
            self.devices,
            n_microbatches=self.n_microbatches,
            loss_fn=None,
            schedule="gpipe",
            soft_placement=self.soft_placement,
        )
        self.pipeline.timeline = self._timeline
        return self.inner.wrap(PipelinedModule(model, self.pipeline))

    def placement(self) -> dict[str, Any]:
        """What the placement report shows of this engine: each module's stage device."""
        if self.pipeline is None:
            return {}
        return {
            "stage_devices": {
                name: spec.to_string()
                for stage, spec in zip(self.pipeline.stages, self.pipeline.specs, strict=True)
                for name, _ in stage.named_children()
            }
        }

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.pipeline is not None:
                self.pipeline.close()
