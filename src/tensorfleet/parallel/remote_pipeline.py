"""A pipeline across worker tasks: each task runs one stage, activations go forward and their
gradients backward between neighbouring tasks, micro-batches in flight.

Transport: ``torch.distributed.pipelining`` (``PipelineStage`` with ``ScheduleGPipe`` or
``Schedule1F1B``) over a gloo process group on CPU, NCCL on GPUs. Why this and not our own
authenticated transport: measured on this project's machine it matches a hand-rolled
isend/irecv pipeline to 1e-8 and in speed; a peer that dies is an immediate
``Connection reset by peer`` on its neighbours (our request/reply wire has no streams
between workers and would notice a dead peer only at a deadline); and the same code runs on
NCCL. The cost is security: like ``allreduce`` mode, the process group is neither
authenticated nor encrypted (docs/security.md), so pipelines across tasks belong on a
trusted network; the ps traffic stays authenticated.

Several pipelines can train as data-parallel replicas sharing the ps: with ``S`` stages,
worker ranks ``[p*S, (p+1)*S)`` form pipeline ``p`` (:func:`pipeline_layout`), each pipeline
its own process group, each stage task pushing its own stage's gradients.

Failure: any error of the schedule (a neighbour that died, a timeout of the process group,
an error in this stage) becomes :class:`~tensorfleet.parallel.errors.PipelineFailed`
naming this stage, its task and the neighbours it exchanges with; the process group's
timeout (``timeout_s``) bounds every wait.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.errors import TensorfleetError
from tensorfleet.parallel.errors import ParallelConfigError, PipelineFailed
from tensorfleet.parallel.local_pipeline import LossFn, PipelineResult
from tensorfleet.parallel.schedule import SCHEDULES
from tensorfleet.parallel.stages import check_microbatches
from tensorfleet.worker.device import torch_device


@dataclass(frozen=True)
class PipelinePosition:
    """Where a worker rank sits: which pipeline, which stage, and the ranks of its pipeline."""

    pipeline: int
    stage: int
    ranks: tuple[int, ...]


def pipeline_layout(world_size: int, num_stages: int, rank: int) -> PipelinePosition:
    """Pipeline ``rank // num_stages``, stage ``rank % num_stages``; the world must be a
    whole number of pipelines."""
    if num_stages < 1 or world_size % num_stages:
        raise ParallelConfigError(
            f"{world_size} worker(s) do not form whole pipelines of {num_stages} stages: use a "
            f"number of workers that is a multiple of {num_stages}"
        )
    if not 0 <= rank < world_size:
        raise ParallelConfigError(f"rank {rank} is outside a world of {world_size}")
    pipeline = rank // num_stages
    ranks = tuple(range(pipeline * num_stages, (pipeline + 1) * num_stages))
    return PipelinePosition(pipeline, rank % num_stages, ranks)


def join_process_group(
    rendezvous_address: str,
    rank: int,
    world_size: int,
    *,
    timeout_s: float = 60.0,
    backend: str = "gloo",
) -> None:
    """Join (create) this process's default torch.distributed group; every wait in it, the
    rendezvous included, is bounded by ``timeout_s``."""
    if dist.is_initialized():
        raise TensorfleetError("a torch.distributed process group already exists in this process")
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{rendezvous_address}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except (RuntimeError, dist.DistStoreError) as exc:
        raise PipelineFailed(
            f"rank {rank} could not join the pipeline group of {world_size} at "
            f"{rendezvous_address} within {timeout_s:g} s: {exc}. Are all stage tasks started, "
            "and is the first worker's address reachable?"
        ) from exc


def pipeline_groups(world_size: int, num_stages: int) -> list[dist.ProcessGroup | None]:
    """One process group per pipeline (collective: every rank calls it, in the same order).
    With a single pipeline the default group is used (``None``)."""
    count = world_size // num_stages
    pipeline_layout(world_size, num_stages, 0)  # validates the shape
    if count == 1:
        return [None]
    return [dist.new_group(list(range(p * num_stages, (p + 1) * num_stages))) for p in range(count)]


class RemotePipelineStage:
    """This task's stage of a pipeline whose other stages run in other tasks.

    Args:
        stage: this stage's module (e.g. ``split_stages(model, 2)[stage_index]``).
        stage_index: its place in the pipeline; stage ``i`` runs on rank ``i`` of ``group``.
        num_stages: the pipeline's number of stages.
        n_microbatches: micro-batches per step; the batch must divide evenly.
        loss_fn: ``loss_fn(output, target)`` per micro-batch; needed on the last stage.
        schedule: ``"1f1b"`` (default) or ``"gpipe"``.
        device: this stage's device string (``/cpu:0``, ``/gpu:0``).
        group: the pipeline's process group (default: the default group).
        stage_tasks: names of the stages' tasks (``["worker:0", "worker:1"]``) for messages.
        loss_reduction: ``"mean"`` (grads scaled by 1/n) or ``"sum"``.

    The batch size is fixed by the first step (the receive buffers are shaped then); a later
    batch of another size is refused with a clear error.
    """

    def __init__(
        self,
        stage: nn.Module,
        stage_index: int,
        num_stages: int,
        *,
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        schedule: str = "1f1b",
        device: str | DeviceSpec = "/cpu:0",
        group: dist.ProcessGroup | None = None,
        stage_tasks: Sequence[str] | None = None,
        loss_reduction: str = "mean",
        soft_placement: bool = False,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ParallelConfigError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if not 0 <= stage_index < num_stages:
            raise ParallelConfigError(
                f"stage_index {stage_index} is outside a pipeline of {num_stages} stages"
            )
        if loss_reduction not in ("mean", "sum"):
            raise ParallelConfigError(
                f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}"
            )
        check_microbatches(n_microbatches, n_microbatches)
        self.last = stage_index == num_stages - 1
        if self.last and loss_fn is None:
            raise ParallelConfigError("the last stage computes the loss: give it loss_fn")
        if not dist.is_initialized():
            raise ParallelConfigError(
                "no torch.distributed process group: call join_process_group(...) first"
            )
        size = dist.get_world_size(group)
        if size != num_stages:
            raise ParallelConfigError(
                f"the pipeline's process group has {size} rank(s) but the pipeline {num_stages} "
                "stages: give each pipeline its own group (pipeline_groups)"
            )
        self.stage_index, self.num_stages = stage_index, num_stages
        self.n_microbatches = n_microbatches
        if stage_tasks is not None and len(stage_tasks) != num_stages:
            raise ParallelConfigError(
                f"stage_tasks names {len(stage_tasks)} task(s) for {num_stages} stages"
            )
        self.stage_names = [
            f"stage {i}" + (f" ({stage_tasks[i]})" if stage_tasks else "")
            for i in range(num_stages)
        ]
        self.device = torch_device(device, soft_placement=soft_placement)
        self.module = stage.to(self.device)
        self.loss_reduction = loss_reduction
        # Imported here, not with the module: torch.distributed.pipelining takes seconds to
        # import (3-7 s measured on this project's 2-core machine), and every session imports
        # this module, so every task's start (and every restart) paid it without a pipeline.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self._pipe_stage = PipelineStage(
            _ContiguousOutput(self.module), stage_index, num_stages, self.device, group=group
        )
        schedule_cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self._loss_fn = loss_fn
        self._schedule = schedule_cls(
            self._pipe_stage,
            n_microbatches,
            loss_fn=loss_fn,
            scale_grads=loss_reduction == "mean",
        )
        self._batch_size: int | None = None
        self._steps = 0
        self._broken = False

    def step(
        self, x: torch.Tensor | None = None, target: torch.Tensor | None = None
    ) -> PipelineResult | None:
        """One forward and backward of the batch through the whole pipeline: the first stage
        passes ``x``, the last ``target``, middle stages nothing. This stage's parameters
        then hold their gradients for the whole batch (replacing earlier ones). The last stage
        returns the loss and the outputs; the others return None."""
        if self._broken:
            raise PipelineFailed(
                f"{self.stage_names[self.stage_index]}: the pipeline broke in an earlier step; "
                "start the stage tasks again"
            )
        first = self.stage_index == 0
        if first and x is None:
            raise ParallelConfigError("the first stage needs the inputs: step(x)")
        if self.last and target is None:
            raise ParallelConfigError("the last stage needs the targets: step(target=y)")
        batch = (x if first else target).shape[0]  # type: ignore[union-attr]
        check_microbatches(batch, self.n_microbatches)
        if self._batch_size is None:
            self._batch_size = batch
        elif batch != self._batch_size:
            raise ParallelConfigError(
                f"the pipeline's batch size was fixed at {self._batch_size} by its first step; "
                f"got {batch}. Keep every batch the same size (drop_last=True)"
            )
        self.module.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (x.to(self.device),) if first and x is not None else ()
        try:
            output = self._schedule.step(
                *args,
                target=target.to(self.device) if self.last and target is not None else None,
                losses=losses if self.last else None,
            )
        except Exception as exc:
            self._broken = True
            neighbours = [
                self.stage_names[i]
                for i in (self.stage_index - 1, self.stage_index + 1)
                if 0 <= i < self.num_stages
            ]
            raise PipelineFailed(
                f"{self.stage_names[self.stage_index]} of {self.num_stages}: the pipeline broke in "
                f"step {self._steps}: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}. "
                f"If this stage did not raise it, a neighbour stopped or died: "
                f"{' or '.join(neighbours) or 'none'}; look at its output"
            ) from exc
        self._steps += 1
        if not self.last:
            return None
        total = torch.stack([loss.detach() for loss in losses]).sum()
        if self.loss_reduction == "mean":
            total = total / self.n_microbatches
        return PipelineResult(total, output.detach())


class _ContiguousOutput(nn.Module):
    """The stage, with its output made contiguous: gloo sends only contiguous tensors (a stage
    ending in ``x.t()`` would otherwise fail on both sides)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.inner(*args)
        return out.contiguous() if isinstance(out, torch.Tensor) else out
