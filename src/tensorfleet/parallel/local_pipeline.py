"""A pipeline inside one task: the stages of a model on local devices, micro-batches in flight.

Each stage runs in its own thread, on its own device, following its schedule
(:mod:`~tensorfleet.parallel.schedule`: GPipe or 1F1B). Stages hand each other detached
tensors through queues: activations forward, the gradients of those activations backward;
each stage runs autograd on its own piece of the graph, so stages overlap in backward too.
Every micro-batch loss is ``loss_fn(output, target) / n`` (``loss_reduction="mean"``), so
the gradients equal those of the whole batch through the unsplit model.

On GPUs, stages on different devices overlap for real. On one CPU the stages share the
cores: the task's intra-op thread budget is divided among the stage threads while the
pipeline is open (restored by :meth:`LocalPipeline.close`); expect no speed-up there, only
the same numbers as the unsplit model (it is how the pipeline is tested on this machine).

Failure: a stage that raises stops the step: the others are woken at once (not at their
deadline) and :class:`~tensorfleet.parallel.errors.PipelineFailed` names the stage, its
device and the micro-batch. A stage that waits longer than ``timeout_s`` for its neighbour
fails naming what it waited for.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
from torch import nn

from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.parallel.errors import ParallelConfigError, PipelineFailed
from tensorfleet.parallel.schedule import SCHEDULES, stage_order
from tensorfleet.parallel.stages import check_microbatches
from tensorfleet.worker.device import torch_device
from tensorfleet.worker.device_scope import place

#: How long after the deadline the caller waits for a failing stage to record its failure.
_REPORT_GRACE_S = 1.0
#: ``loss_fn(output, target) -> scalar tensor`` on the last stage, for one micro-batch.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PipelineResult:
    """One step's loss over the whole batch and the last stage's outputs (both detached)."""

    loss: torch.Tensor
    outputs: torch.Tensor


class _Abort:
    """Put in every queue when a stage fails, so that its neighbours stop waiting."""


class _Aborted(Exception):
    pass


class LocalPipeline:
    """``stages`` (e.g. from :func:`~tensorfleet.parallel.stages.split_stages`) on ``devices``
    (one device string per stage; default: all on the CPU), trained with micro-batches.

    :meth:`step` runs one forward and backward of the batch; the stages' parameters then hold
    the gradients of the whole batch (replacing earlier ones), ready for the optimizer or the
    ps push.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[str | DeviceSpec] | None = None,
        *,
        n_microbatches: int,
        loss_fn: LossFn,
        schedule: str = "1f1b",
        loss_reduction: str = "mean",
        soft_placement: bool = False,
        timeout_s: float = 300.0,
    ) -> None:
        if not stages:
            raise ParallelConfigError("a pipeline needs at least one stage")
        if schedule not in SCHEDULES:
            raise ParallelConfigError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ParallelConfigError(
                f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}"
            )
        check_microbatches(n_microbatches, n_microbatches)  # validates the count itself
        if timeout_s <= 0:
            raise ParallelConfigError(f"timeout_s must be > 0, got {timeout_s}")
        specs = list(devices) if devices is not None else ["/cpu:0"] * len(stages)
        if len(specs) != len(stages):
            raise ParallelConfigError(
                f"{len(stages)} stages but {len(specs)} devices: give one device per stage"
            )
        self.stages = [
            place(s, d, soft_placement=soft_placement) for s, d in zip(stages, specs, strict=True)
        ]
        self.specs = [d if isinstance(d, DeviceSpec) else DeviceSpec.parse(d) for d in specs]
        self.devices = [torch_device(d, soft_placement=soft_placement) for d in self.specs]
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.schedule = schedule
        self.loss_reduction = loss_reduction
        self.timeout_s = float(timeout_s)
        self._threads_before = torch.get_num_threads()
        cpu_stages = sum(d.type == "cpu" for d in self.devices)
        if cpu_stages > 1:
            torch.set_num_threads(max(1, self._threads_before // cpu_stages))
        self._pool = ThreadPoolExecutor(len(self.stages), thread_name_prefix="stage")
        self._closed = False
        self._broken = False

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the stage threads and give torch its thread budget back."""
        if not self._closed:
            self._closed = True
            # after a failure a stage may still be stuck in its computation: do not wait for it
            self._pool.shutdown(wait=not self._broken, cancel_futures=True)
            torch.set_num_threads(self._threads_before)

    def step(self, x: torch.Tensor, target: torch.Tensor) -> PipelineResult:
        """Forward and backward of the batch ``(x, target)`` through every stage."""
        if self._closed or self._broken:
            raise ParallelConfigError(
                "this LocalPipeline is closed or a stage failed in an earlier step; create a new one"
            )
        n = self.n_microbatches
        check_microbatches(x.shape[0], n)
        if target.shape[0] != x.shape[0]:
            raise ParallelConfigError(
                f"inputs and targets differ in batch size: {x.shape[0]} and {target.shape[0]}"
            )
        for stage in self.stages:
            stage.zero_grad(set_to_none=True)
        count = len(self.stages)
        run = _Step(
            xs=list(torch.chunk(x, n)),
            targets=list(torch.chunk(target, n)),
            forward_in=[queue.SimpleQueue() for _ in range(count)],
            backward_in=[queue.SimpleQueue() for _ in range(count)],
            deadline=time.monotonic() + self.timeout_s,
        )
        futures = [self._pool.submit(self._run_stage, s, run) for s in range(count)]
        # Return as soon as a stage fails: a stage stuck in its own computation cannot be
        # interrupted, but it must not hold the caller (it finds the abort when it resumes).
        _, pending = wait(
            futures, timeout=self.timeout_s + _REPORT_GRACE_S, return_when=FIRST_EXCEPTION
        )
        if run.failure is None and pending:
            _, pending = wait(pending, timeout=_REPORT_GRACE_S)  # a failure being recorded
        if run.failure is not None:
            self._broken = True
            s, exc = run.failure
            raise PipelineFailed(
                f"pipeline stage {s} of {count} on {self.specs[s].to_string() or 'the CPU'} "
                f"failed at {run.position.get(s, 'its start')}: {type(exc).__name__}: {exc}; "
                "the other stages were stopped"
            ) from exc
        if pending:
            self._broken = True
            stuck = [s for s, f in enumerate(futures) if f in pending]
            raise PipelineFailed(
                f"pipeline stage(s) {stuck} still running {self.timeout_s:g} s after the step "
                f"started, at {[run.position.get(s, 'its start') for s in stuck]}: stuck or too "
                "slow (raise timeout_s if only slow)"
            )
        total = sum(run.losses)
        return PipelineResult(total.detach(), torch.cat(run.outputs))

    def _run_stage(self, s: int, run: _Step) -> None:
        try:
            self._stage_body(s, run)
        except _Aborted:
            raise
        except BaseException as exc:
            with run.lock:
                if run.failure is None:
                    run.failure = (s, exc)
            for q in [*run.forward_in, *run.backward_in]:
                q.put(_Abort())
            raise

    def _stage_body(self, s: int, run: _Step) -> None:
        stage, device = self.stages[s], self.devices[s]
        last = s == len(self.stages) - 1
        n = self.n_microbatches
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        for kind, m in stage_order(self.schedule, s, len(self.stages), n):
            run.position[s] = f"the {'forward' if kind == 'F' else 'backward'} of micro-batch {m}"
            if kind == "F":
                if s == 0:
                    inp = run.xs[m].to(device)
                    out = stage(inp)
                    held: torch.Tensor | None = None
                else:
                    received = self._receive(run.forward_in[s], run, s, m, "activations", s - 1)
                    held = received.to(device).requires_grad_(received.is_floating_point())
                    out = stage(held)
                if last:
                    loss = self.loss_fn(out, run.targets[m].to(device))
                    if self.loss_reduction == "mean":
                        loss = loss / n
                    run.losses[m] = loss.detach()
                    run.outputs[m] = out.detach()
                    saved[m] = (held, loss)
                else:
                    saved[m] = (held, out)
                    run.forward_in[s + 1].put((m, out.detach().contiguous()))
            else:
                held, out = saved.pop(m)
                if last:
                    out.backward()
                else:
                    grad = self._receive(run.backward_in[s], run, s, m, "gradients", s + 1)
                    out.backward(grad.to(out.device))
                if s > 0:
                    g = held.grad if held is not None and held.grad is not None else None
                    if g is None and held is not None:
                        g = torch.zeros_like(held)
                    run.backward_in[s - 1].put((m, g))

    def _receive(
        self, q: queue.SimpleQueue, run: _Step, s: int, m: int, what: str, source: int
    ) -> torch.Tensor:
        remaining = run.deadline - time.monotonic()
        try:
            item = q.get(timeout=max(0.0, remaining))
        except queue.Empty:
            raise PipelineFailed(
                f"pipeline stage {s} waited {self.timeout_s:g} s for the {what} of micro-batch "
                f"{m} from stage {source}, which never came (stage {source} is stuck or too "
                "slow: raise timeout_s if it is only slow)"
            ) from None
        if isinstance(item, _Abort):
            raise _Aborted()
        got, tensor = item
        if got != m:  # the schedules guarantee the order; a mismatch is a bug of ours
            raise RuntimeError(f"stage {s} expected micro-batch {m} from stage {source}, got {got}")
        return tensor


@dataclass
class _Step:
    xs: list[torch.Tensor]
    targets: list[torch.Tensor]
    forward_in: list[queue.SimpleQueue]
    backward_in: list[queue.SimpleQueue]
    deadline: float

    def __post_init__(self) -> None:
        n = len(self.xs)
        self.losses: list[torch.Tensor] = [torch.zeros(())] * n
        self.outputs: list[torch.Tensor] = [torch.zeros(())] * n
        self.position: dict[int, str] = {}
        self.failure: tuple[int, BaseException] | None = None
        self.lock = threading.Lock()
