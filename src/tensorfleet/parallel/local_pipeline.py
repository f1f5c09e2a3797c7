"""A pipeline inside one task: the stages of a model on local devices, micro-batches in flight.

Each stage runs in its own thread, on its own device, following its schedule
(:mod:`~tensorfleet.parallel.schedule`: GPipe or 1F1B). Stages hand each other detached
tensors through queues: activations forward, the gradients of those activations backward;
each stage runs autograd on its own piece of the graph, so stages overlap in backward too.
Every micro-batch loss is ``loss_fn(output, target) / n`` (``loss_reduction="mean"``), so
the gradients equal those of the whole batch through the unsplit model.

On GPUs, stages on different devices overlap for real (in the backward behind
:class:`PipelinedModule`, the stages on the device of the loss run in autograd's own thread
of that device, downstream first: :mod:`~tensorfleet.parallel.autograd_threads`). On one CPU
the stages share the cores: the task's intra-op thread budget is divided among the stage
threads while the pipeline is open (restored by :meth:`LocalPipeline.close`); expect no
speed-up there, only the same numbers as the unsplit model (it is how the pipeline is tested
on this machine).

The bubble, measured: every step records how long each stage computed (its forwards and
backwards, not its waits for a neighbour) against the step's wall time, and
:attr:`LocalPipeline.last_bubble` (a :class:`BubbleReport`) gives each stage's idle share
beside the schedule's own bubble ``(S - 1) / (M + S - 1)`` for ``S`` stages and ``M``
micro-batches: what a perfect pipeline of equal stages would idle. A share well above that
says the stages are unequal (move layers from the busiest stage) or the micro-batches too
few; ``PipelineResult.bubble`` has the same for :meth:`LocalPipeline.step`. With a
timeline (:attr:`LocalPipeline.timeline`; a session with ``timeline=`` and
``stage_devices=`` sets it), each stage's forwards and backwards are spans on the stage's
thread, and each step a ``pipeline step`` span on the ``pipeline`` track carries the idle
shares and the schedule's bubble (docs/timeline.md). A stage on a GPU is timed until its
device ran it (CUDA events around each micro-batch, read at the step's end: no wait per
micro-batch).

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
from tensorfleet.parallel.autograd_threads import backward_thread_device, same_device
from tensorfleet.parallel.errors import ParallelConfigError, PipelineFailed
from tensorfleet.parallel.schedule import SCHEDULES, bubble_fraction, stage_order
from tensorfleet.parallel.stages import check_microbatches
from tensorfleet.worker.device import torch_device
from tensorfleet.worker.device_scope import place
from tensorfleet.worker.timeline import NO_TIMELINE, Timeline

#: How long after the deadline the caller waits for a failing stage to record its failure.
_REPORT_GRACE_S = 1.0
#: ``loss_fn(output, target) -> scalar tensor`` on the last stage, for one micro-batch.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BubbleReport:
    """Where one pipeline step's time went, per stage.

    Attributes:
        step_s: the step's wall time (forward and backward phases).
        busy_s: each stage's seconds of computing (its forwards and backwards, without its
            waits for activations or gradients from a neighbour).
        schedule_bubble: the schedule's own idle share for these stages and micro-batches,
            ``(S - 1) / (M + S - 1)`` (:func:`~tensorfleet.parallel.schedule.bubble_fraction`).
    """

    step_s: float
    busy_s: tuple[float, ...]
    schedule_bubble: float

    @property
    def idle_shares(self) -> tuple[float, ...]:
        """Each stage's share of the step spent not computing, in [0, 1]."""
        if self.step_s <= 0:
            return tuple(0.0 for _ in self.busy_s)
        return tuple(min(1.0, max(0.0, 1.0 - busy / self.step_s)) for busy in self.busy_s)

    def describe(self) -> str:
        """One line, e.g. ``pipeline bubble: stage idle 31% 24% (schedule's own 20%) of a
        41.2 ms step``."""
        shares = " ".join(f"{share:.0%}" for share in self.idle_shares)
        return (
            f"pipeline bubble: stage idle {shares} (schedule's own {self.schedule_bubble:.0%}) "
            f"of a {self.step_s * 1e3:.1f} ms step"
        )


@dataclass(frozen=True)
class PipelineResult:
    """One step's loss over the whole batch and the last stage's outputs (both detached),
    and where the step's time went (:class:`BubbleReport`)."""

    loss: torch.Tensor
    outputs: torch.Tensor
    bubble: BubbleReport | None = None


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
        loss_fn: LossFn | None,
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
        self.last_bubble: BubbleReport | None = None
        """The last completed step's :class:`BubbleReport` (None before the first)."""
        self.timeline: Timeline = NO_TIMELINE
        """Where the stages' spans go (off by default)."""

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
        if self.loss_fn is None:
            raise ParallelConfigError(
                "step(x, target) needs loss_fn; without one use PipelinedModule (the loss is "
                "computed by the caller)"
            )
        if target.shape[0] != x.shape[0]:
            raise ParallelConfigError(
                f"inputs and targets differ in batch size: {x.shape[0]} and {target.shape[0]}"
            )
        run = self._start(x, target)
        count = len(self.stages)
        self._run_phase(
            run,
            [stage_order(self.schedule, s, count, self.n_microbatches) for s in range(count)],
        )
        total = sum(run.losses)
        return PipelineResult(total.detach(), torch.cat(run.outputs), self._finish(run))

    def _finish(self, run: _Step) -> BubbleReport:
        """The completed step's bubble, kept as :attr:`last_bubble`."""
        self.last_bubble = BubbleReport(
            run.wall_s,
            tuple(_busy_seconds(spans) for spans in run.clocked),
            bubble_fraction(len(self.stages), self.n_microbatches),
        )
        if self.timeline.enabled and run.started_ns is not None:
            self.timeline.add(
                "pipeline step",
                run.started_ns,
                time.perf_counter_ns(),
                track="pipeline",
                idle_shares=[round(share, 4) for share in self.last_bubble.idle_shares],
                schedule_bubble=round(self.last_bubble.schedule_bubble, 4),
            )
        return self.last_bubble

    def _start(self, x: torch.Tensor, target: torch.Tensor | None) -> _Step:
        """A new step's state after the checks; zeroes the stages' gradients."""
        if self._closed or self._broken:
            raise ParallelConfigError(
                "this LocalPipeline is closed or a stage failed in an earlier step; create a new one"
            )
        n = self.n_microbatches
        check_microbatches(x.shape[0], n)
        for stage in self.stages:
            stage.zero_grad(set_to_none=True)
        count = len(self.stages)
        return _Step(
            xs=list(torch.chunk(x, n)),
            targets=list(torch.chunk(target, n)) if target is not None else [],
            forward_in=[queue.SimpleQueue() for _ in range(count)],
            backward_in=[queue.SimpleQueue() for _ in range(count)],
            deadline=time.monotonic() + self.timeout_s,
        )

    def _run_phase(
        self,
        run: _Step,
        orders: list[list[tuple[str, int]]],
        inline_on: torch.device | None = None,
    ) -> None:
        """Every stage runs its ``orders[s]`` in its thread, except the stages on
        ``inline_on``: a backward phase run by autograd's thread of that device runs them in
        that thread, downstream first, since a stage's backward needs its downstream
        neighbour's gradients (:mod:`~tensorfleet.parallel.autograd_threads`). The first
        failure is raised."""
        count = len(self.stages)
        started = time.perf_counter()
        if run.started_ns is None:
            run.started_ns = time.perf_counter_ns()
        run.deadline = time.monotonic() + self.timeout_s
        here = [same_device(d, inline_on) for d in self.devices]
        futures = [
            self._pool.submit(self._run_stage, s, run, orders[s])
            for s in range(count)
            if not here[s]
        ]
        for s in reversed(range(count)):
            if here[s] and run.failure is None:
                try:
                    self._run_stage(s, run, orders[s])
                except Exception:  # recorded in run.failure (or another stage's abort)
                    break
        # Return as soon as a stage fails: a stage stuck in its own computation cannot be
        # interrupted, but it must not hold the caller (it finds the abort when it resumes).
        remaining = max(0.0, run.deadline - time.monotonic())
        _, pending = wait(futures, timeout=remaining + _REPORT_GRACE_S, return_when=FIRST_EXCEPTION)
        if run.failure is None and pending:
            _, pending = wait(pending, timeout=_REPORT_GRACE_S)  # a failure being recorded
        run.wall_s += time.perf_counter() - started
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
            pooled = [s for s in range(count) if not here[s]]
            stuck = [s for s, f in zip(pooled, futures, strict=True) if f in pending]
            raise PipelineFailed(
                f"pipeline stage(s) {stuck} still running {self.timeout_s:g} s after the step "
                f"started, at {[run.position.get(s, 'its start') for s in stuck]}: stuck or too "
                "slow (raise timeout_s if only slow)"
            )

    def _run_stage(self, s: int, run: _Step, order: list[tuple[str, int]]) -> None:
        try:
            self._stage_body(s, run, order)
        except _Aborted:
            raise
        except BaseException as exc:
            with run.lock:
                if run.failure is None:
                    run.failure = (s, exc)
            for q in [*run.forward_in, *run.backward_in]:
                q.put(_Abort())
            raise

    def _stage_body(self, s: int, run: _Step, order: list[tuple[str, int]]) -> None:
        stage, device = self.stages[s], self.devices[s]
        last = s == len(self.stages) - 1
        with_loss = last and self.loss_fn is not None
        n = self.n_microbatches
        saved = run.saved[s]
        for kind, m in order:
            run.position[s] = f"the {'forward' if kind == 'F' else 'backward'} of micro-batch {m}"
            if kind == "F":
                if s == 0:
                    held: torch.Tensor | None = None
                    started = _start_clock(device)
                    out = stage(run.xs[m].to(device))
                else:
                    received = self._receive(run.forward_in[s], run, s, m, "activations", s - 1)
                    started = _start_clock(device)
                    held = received.to(device).requires_grad_(received.is_floating_point())
                    out = stage(held)
                if with_loss:
                    loss = self.loss_fn(out, run.targets[m].to(device))  # type: ignore[misc]
                    if self.loss_reduction == "mean":
                        loss = loss / n
                    run.losses[m] = loss.detach()
                    run.outputs[m] = out.detach()
                    saved[m] = (held, loss)
                elif last:
                    run.outputs[m] = out.detach()
                    saved[m] = (held, out)
                else:
                    saved[m] = (held, out)
                    run.forward_in[s + 1].put((m, out.detach().contiguous()))
            else:
                held, out = saved.pop(m)
                if with_loss:
                    started = _start_clock(device)
                    out.backward()
                else:
                    source = s + 1 if not last else "the caller"
                    grad = self._receive(run.backward_in[s], run, s, m, "gradients", source)
                    started = _start_clock(device)
                    out.backward(grad.to(out.device))
                if s > 0:
                    g = held.grad if held is not None and held.grad is not None else None
                    if g is None and held is not None:
                        g = torch.zeros_like(held)
                    run.backward_in[s - 1].put((m, g))
            ended = _start_clock(device)
            run.clocked[s].append((started, ended))
            if self.timeline.enabled:
                self.timeline.add(
                    f"stage {s} {'forward' if kind == 'F' else 'backward'}",
                    int(started[0] * 1e9),
                    int(ended[0] * 1e9),
                    micro_batch=m,
                )

    def _receive(
        self, q: queue.SimpleQueue, run: _Step, s: int, m: int, what: str, source: int | str
    ) -> torch.Tensor:
        remaining = run.deadline - time.monotonic()
        try:
            item = q.get(timeout=max(0.0, remaining))
        except queue.Empty:
            raise PipelineFailed(
                f"pipeline stage {s} waited {self.timeout_s:g} s for the {what} of micro-batch "
                f"{m} from {_name(source)}, which never came ({_name(source)} is stuck or too "
                "slow: raise timeout_s if it is only slow)"
            ) from None
        if isinstance(item, _Abort):
            raise _Aborted()
        got, tensor = item
        if got != m:  # the schedules guarantee the order; a mismatch is a bug of ours
            raise PipelineFailed(
                f"stage {s} expected micro-batch {m} from {_name(source)}, got {got}"
            )
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
        self.saved: list[dict[int, tuple[torch.Tensor | None, torch.Tensor]]] = [
            {} for _ in range(len(self.forward_in))
        ]
        self.failure: tuple[int, BaseException] | None = None
        self.lock = threading.Lock()
        self.clocked: list[list[tuple[_Tick, _Tick]]] = [[] for _ in self.forward_in]
        """Each stage's (start, end) of each forward and backward it ran in this step."""
        self.wall_s = 0.0
        """The wall time of this step's phases so far."""
        self.started_ns: int | None = None
        """When its first phase started (``time.perf_counter_ns``)."""


#: A moment of a stage: the wall clock (``time.perf_counter``), and on a GPU a CUDA event
#: recorded on its device's current stream (None on the CPU).
_Tick = tuple[float, "torch.cuda.Event | None"]


def _start_clock(device: torch.device) -> _Tick:
    """Now, for a stage on ``device``: on a GPU also an event in the device's stream, so
    that the stage's computing time is the GPU's, measured without waiting for it."""
    if device.type != "cuda":
        return time.perf_counter(), None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return time.perf_counter(), event


def _busy_seconds(spans: list[tuple[_Tick, _Tick]]) -> float:
    """A stage's computing time in a step: the sum of its spans (on a GPU, the time between
    their events, once the last one has completed)."""
    total = 0.0
    for (start, start_event), (end, end_event) in spans:
        if start_event is not None and end_event is not None:
            end_event.synchronize()
            total += start_event.elapsed_time(end_event) / 1000.0
        else:
            total += end - start
    return total


def _name(source: int | str) -> str:
    return f"stage {source}" if isinstance(source, int) else str(source)


class PipelinedModule(nn.Module):
    """A GPipe pipeline behind an ordinary module, for the step-closure API.

    ``wrapper(x)`` runs every micro-batch's forward through the stages (one thread per stage,
    stages overlapping) and returns the last stage's outputs concatenated; the caller
    computes the loss on them; ``loss.backward()`` runs every micro-batch's backward through
    the stages, overlapping again, and the stages' parameters (the model's own) receive the
    gradients of the whole batch. The loss is computed after the whole forward, so the
    schedule is GPipe; :meth:`LocalPipeline.step` with a ``loss_fn`` also offers 1F1B.

    ``pipeline`` is a :class:`LocalPipeline` built with ``loss_fn=None``. ``wrapper.module``
    is the model whose parameters the stages share (for ``state_dict``). Without grad mode
    the stages run one after the other on the whole batch.
    """

    def __init__(self, model: nn.Module, pipeline: LocalPipeline) -> None:
        super().__init__()
        if pipeline.loss_fn is not None:
            raise ParallelConfigError(
                "PipelinedModule needs a LocalPipeline built with loss_fn=None: the caller "
                "computes the loss on the wrapper's output"
            )
        self.module = model
        object.__setattr__(self, "pipeline", pipeline)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pipeline: LocalPipeline = self.pipeline  # type: ignore[assignment]
        if not torch.is_grad_enabled():
            for stage, device in zip(pipeline.stages, pipeline.devices, strict=True):
                x = stage(x.to(device))
            return x
        params = [p for stage in pipeline.stages for p in stage.parameters() if p.requires_grad]
        return _PipelineFunction.apply(pipeline, x, *params)


class _PipelineFunction(torch.autograd.Function):
    """Forward: every micro-batch's forward, pipelined. Backward: every backward, pipelined;
    the stages' parameters get their gradients from the stage threads' own autograd, so
    nothing is returned for them."""

    @staticmethod
    def forward(
        ctx, pipeline: LocalPipeline, x: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        run = pipeline._start(x, None)
        count, n = len(pipeline.stages), pipeline.n_microbatches
        pipeline._run_phase(run, [[("F", m) for m in range(n)] for _ in range(count)])
        ctx.pipeline, ctx.run, ctx.n_params = pipeline, run, len(params)
        return torch.cat(run.outputs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        pipeline: LocalPipeline = ctx.pipeline
        run: _Step = ctx.run
        count, n = len(pipeline.stages), pipeline.n_microbatches
        for m, piece in enumerate(torch.chunk(grad_out, n)):
            run.backward_in[count - 1].put((m, piece))
        # The stages on this node's own device run in this thread (autograd_threads).
        pipeline._run_phase(
            run,
            [[("B", m) for m in range(n)] for _ in range(count)],
            inline_on=backward_thread_device(grad_out),
        )
        pipeline._finish(run)
        ctx.run = None
        return (None, None, *([None] * ctx.n_params))
