"""A pipeline across tasks driven by its leader's training loop (the step-closure API).

The leader (stage 0, a worker task) runs the user's loop: ``sess.model(x)`` sends every
micro-batch's activations down the stages and returns the last stage's outputs; the loss is
computed there, in the leader, and ``loss.backward()`` sends the outputs' gradients back to
the last stage, from which they flow up to the leader. The other stages (``stage`` tasks)
run no user loop at all: :func:`serve_stage` obeys the leader's commands until it ends
training, as a TensorFlow task serves the ops placed on it. Micro-batch forwards overlap
across stages (GPipe): the leader computes micro-batch m+1 while stage 1 computes m.

Every message from the leader to a stage starts with a command (:class:`Command`):

- ``CONFIGURE``: the stage boundaries (the leader's cut of the model; each stage checks the
  model it built has the same layers) and the micro-batch count;
- ``STEP``: one step: the stage receives each micro-batch's activations from its upstream
  neighbour (the leader for stage 1), sends its outputs downstream (the last stage: to the
  leader), then receives the gradients of its outputs and sends its inputs' gradients
  upstream, and finally sends its parameters' gradients to the leader
  (:class:`~tensorfleet.parallel.stage_exchange.StageExchange`);
- ``VALUES``: the stage receives its parameters' new values and the global step;
- ``END``: training is over; the stage returns.

Each tensor travels as a small int64 header (micro-batch, dtype, shape) then its data, so
shapes may change between steps. Transport: torch.distributed point-to-point over the
pipeline's gloo group (see :mod:`~tensorfleet.parallel.remote_pipeline` for why, and its
trust boundary). Every wait is bounded by the process group's timeout; a dead neighbour is
an immediate error naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist
from torch import nn

from tensorfleet.parallel.errors import ParallelConfigError, PipelineFailed
from tensorfleet.parallel.stage_exchange import StageControl, StageExchange, stage_parameter_names
from tensorfleet.parallel.stages import check_microbatches, split_stages

#: dtypes a stage boundary may carry, by code in the tensor header.
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # micro-batch, dtype, ndim, dims
_COMMAND = 32  # command, then its arguments (CONFIGURE: layers, micro-batches, boundaries)


class Command(IntEnum):
    """What the leader asks a stage to do next."""

    CONFIGURE = 1
    STEP = 2
    VALUES = 3
    END = 4


@dataclass(frozen=True)
class PipelinePlan:
    """One pipeline: its stage count, where the model is cut, the micro-batch count, and the
    names of its stages' tasks (for messages)."""

    boundaries: tuple[int, ...]
    n_microbatches: int
    stage_names: tuple[str, ...]

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) + 1


class _Link:
    """Point-to-point tensors with headers, within one pipeline group, naming peers in errors."""

    def __init__(self, group: dist.ProcessGroup | None, me: int, names: Sequence[str]) -> None:
        self.group, self.me, self.names = group, me, list(names)
        self._pending: list[tuple[object, torch.Tensor, int]] = []

    def send(self, peer: int, tensor: torch.Tensor, m: int = 0) -> None:
        """Start sending ``tensor`` (micro-batch ``m``) to ``peer``; :meth:`flush` waits. Sends
        do not block: a blocking send would deadlock two stages that each send before they
        receive (the leader's next activation, stage 1's previous output)."""
        tensor = tensor.detach().contiguous().cpu()
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ParallelConfigError(
                f"a stage boundary carries a {tensor.dtype} tensor of {tensor.dim()} dimensions; "
                f"supported: up to {_MAX_DIMS} dimensions of {[str(d) for d in _DTYPES]}"
            )
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1], header[2] = m, _DTYPES.index(tensor.dtype), tensor.dim()
        header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        for part in (header, tensor):
            work = self._do(dist.isend, part, peer, "sending to")
            self._pending.append((work, part, peer))

    def flush(self) -> None:
        """Wait until every started send was received (bounded by the group's timeout)."""
        pending, self._pending = self._pending, []
        for work, _, peer in pending:
            try:
                work.wait()  # type: ignore[attr-defined]
            except Exception as exc:
                raise self._failure(peer, "sending to", exc) from exc

    def recv(self, peer: int, device: torch.device, m: int | None = None) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._do(dist.recv, header, peer, "receiving from")
        got, code, ndim = (int(v) for v in header[:3])
        if m is not None and got != m or not 0 <= code < len(_DTYPES) or not 0 <= ndim <= _MAX_DIMS:
            raise PipelineFailed(
                f"{self.names[self.me]} got a malformed header from {self.names[peer]} "
                f"(micro-batch {got}, expected {m}); the stages are out of step"
            )
        tensor = torch.empty([int(d) for d in header[3 : 3 + ndim]], dtype=_DTYPES[code])
        self._do(dist.recv, tensor, peer, "receiving from")
        return tensor.to(device)

    def command(self, peer: int, command: Command, *args: int) -> None:
        vector = torch.zeros(_COMMAND, dtype=torch.int64)
        vector[0] = int(command)
        vector[1 : 1 + len(args)] = torch.tensor(args, dtype=torch.int64)
        self._do(dist.send, vector, peer, "sending a command to")

    def await_command(self) -> tuple[Command, list[int]]:
        vector = torch.zeros(_COMMAND, dtype=torch.int64)
        self._do(dist.recv, vector, 0, "waiting for the next command from")
        try:
            return Command(int(vector[0])), [int(v) for v in vector[1:]]
        except ValueError:
            raise PipelineFailed(
                f"{self.names[self.me]} got an unknown command {int(vector[0])} from the leader"
            ) from None

    def _do(self, op, tensor: torch.Tensor, peer: int, doing: str):  # type: ignore[no-untyped-def]
        key = "group_dst" if op in (dist.send, dist.isend) else "group_src"
        try:
            return op(tensor, group=self.group, **{key: peer})
        except Exception as exc:
            raise self._failure(peer, doing, exc) from exc

    def _failure(self, peer: int, doing: str, exc: Exception) -> PipelineFailed:
        return PipelineFailed(
            f"{self.names[self.me]} failed {doing} {self.names[peer]}: {type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:400]}. {self.names[peer]} probably stopped or died; "
            "look at its output"
        )


class PipelineLeader:
    """The leader's side: stage 0's module, the commands, the activations' round trip, and the
    exchange of parameters with the other stages. ``model`` is the whole model (its
    parameters are the variables the leader pushes and pulls)."""

    def __init__(
        self,
        model: nn.Sequential,
        plan: PipelinePlan,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        if not 2 <= plan.num_stages <= _COMMAND - 3:
            raise ParallelConfigError(
                f"a pipeline across tasks needs 2 to {_COMMAND - 3} stages, got {plan.num_stages}"
            )
        check_microbatches(plan.n_microbatches, plan.n_microbatches)
        self.model, self.plan = model, plan
        self.stages = split_stages(model, boundaries=list(plan.boundaries))
        self.device = device or torch.device("cpu")
        self.stage0 = self.stages[0].to(self.device)
        self.link = _Link(group, 0, plan.stage_names)
        self.exchange = StageExchange(
            stage_parameter_names(self.stages),
            0,
            dict(model.named_parameters()),
            group=group,
            stage_names=plan.stage_names,
        )
        self._steps = 0
        self._ended = False

    def configure(self) -> None:
        """Tell every stage where the model is cut (they check their model against it)."""
        layers = len(self.model)
        for s in range(1, self.plan.num_stages):
            self.link.command(
                s, Command.CONFIGURE, layers, self.plan.n_microbatches, *self.plan.boundaries
            )

    def module(self) -> nn.Module:
        """What the step closure calls: the whole pipeline as one module."""
        return DrivenPipelineModule(self)

    def send_values(self, control: StageControl) -> None:
        """Every stage gets its parameters' current values and ``control``."""
        for s in range(1, self.plan.num_stages):
            self.link.command(s, Command.VALUES)
        self.exchange.scatter_values(control)

    def gather_gradients(self) -> None:
        """The other stages' gradients of the last step into the model's ``.grad``."""
        self.exchange.gather_gradients()

    def end(self) -> None:
        """Training is over: every stage returns from :func:`serve_stage` (idempotent)."""
        if not self._ended:
            self._ended = True
            for s in range(1, self.plan.num_stages):
                self.link.command(s, Command.END)


class DrivenPipelineModule(nn.Module):
    """The leader's pipeline as a module: forward through every stage (outputs back at the
    leader), backward back through every stage. ``module`` is the whole model."""

    def __init__(self, leader: PipelineLeader) -> None:
        super().__init__()
        self.module = leader.model
        object.__setattr__(self, "leader", leader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leader: PipelineLeader = self.leader  # type: ignore[assignment]
        if not torch.is_grad_enabled():
            raise ParallelConfigError(
                "a pipeline across tasks runs training steps only; evaluate with the whole model "
                "(sess.model.module, after the leader pulled its values)"
            )
        params = [p for p in leader.stage0.parameters() if p.requires_grad]
        return _DrivenFunction.apply(leader, x, *params)


class _DrivenFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, leader: PipelineLeader, x: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        plan, link = leader.plan, leader.link
        n, last = plan.n_microbatches, plan.num_stages - 1
        check_microbatches(x.shape[0], n)
        for s in range(1, plan.num_stages):
            link.command(s, Command.STEP, n, leader._steps)
        outs = []
        with torch.enable_grad():
            for m, chunk in enumerate(torch.chunk(x, n)):
                out = leader.stage0(chunk.to(leader.device))
                link.send(1, out, m)
                outs.append(out)
        results = [link.recv(last, leader.device, m) for m in range(n)]
        link.flush()
        ctx.leader, ctx.outs, ctx.n_params = leader, outs, len(params)
        return torch.cat(results)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        leader: PipelineLeader = ctx.leader
        n, last = leader.plan.n_microbatches, leader.plan.num_stages - 1
        for m, piece in enumerate(torch.chunk(grad_out, n)):
            leader.link.send(last, piece, m)
        for m, out in enumerate(ctx.outs):
            grad = leader.link.recv(1, out.device, m)
            torch.autograd.backward(out, grad)
        leader.link.flush()
        leader._steps += 1
        ctx.outs = None
        return (None, None, *([None] * ctx.n_params))


def serve_stage(
    model: nn.Sequential,
    stage_index: int,
    stage_names: Sequence[str],
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> int:
    """Run stage ``stage_index`` (>= 1) of ``model`` for the pipeline's leader until it ends
    training; returns the number of steps served. ``model`` must be built like the leader's
    (same layers); its parameters get their values from the leader."""
    if stage_index < 1:
        raise ParallelConfigError(
            "stage 0 is the leader: it runs the training loop, not serve_stage"
        )
    names = list(stage_names)
    link = _Link(group, stage_index, names)
    device = device or torch.device("cpu")
    command, args = link.await_command()
    if command is not Command.CONFIGURE:
        raise PipelineFailed(f"{names[stage_index]} expected CONFIGURE first, got {command.name}")
    layers = args[0]  # args[1]: the micro-batch count; each STEP says its own
    boundaries = [b for b in args[2 : 2 + len(names) - 1]]
    if len(model) != layers:
        raise ParallelConfigError(
            f"{names[stage_index]} built a model of {len(model)} layers, the leader's has {layers}: "
            "every task of a pipeline must build the same model"
        )
    stages = split_stages(model, boundaries=boundaries)
    stage = stages[stage_index].to(device)
    exchange = StageExchange(
        stage_parameter_names(stages),
        stage_index,
        dict(stage.named_parameters()),
        group=group,
        stage_names=names,
    )
    last = stage_index == len(names) - 1
    downstream = 0 if last else stage_index + 1
    steps = 0
    while True:
        command, args = link.await_command()
        if command is Command.END:
            return steps
        if command is Command.VALUES:
            exchange.scatter_values()
            continue
        if command is not Command.STEP:
            raise PipelineFailed(
                f"{names[stage_index]} got {command.name} in the middle of training"
            )
        n = args[0]
        stage.zero_grad(set_to_none=True)
        saved = []
        for m in range(n):
            held = link.recv(stage_index - 1, device, m)
            held.requires_grad_(held.is_floating_point())
            out = stage(held)
            link.send(downstream, out, m)
            saved.append((held, out))
        link.flush()
        for m, (held, out) in enumerate(saved):
            grad = link.recv(downstream, device, m)
            torch.autograd.backward(out, grad)
            link.send(
                stage_index - 1, held.grad if held.grad is not None else torch.zeros_like(held), m
            )
        exchange.gather_gradients()
        steps += 1
