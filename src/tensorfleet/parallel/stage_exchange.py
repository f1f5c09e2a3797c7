"""One pipeline as one replica for the parameter servers: its stages' gradients gathered to
the pipeline's leader (stage 0), the updated values sent back.

Why: the ps modes (async, sync with backups, bounded staleness) count *replicas*. If every
stage task pushed its own slice, a sync step would average each variable over the wrong
number of contributions and an optimizer with state (Adam, momentum) would see zeros for the
variables a task does not own. So only the leader of each pipeline talks to the ps, with the
whole model, exactly like a between-graph worker; the other stage tasks talk only to their
leader, over the pipeline's process group:

1. after the schedule's step, stage ``s > 0`` sends its gradients (one flat buffer per
   dtype, parameters in name order) to the leader, which puts them in the model's ``.grad``;
2. the leader pushes and pulls (the update mode's exchange), then sends each stage its
   parameters' new values and a small control vector (global step, stop, made_step);
3. stage ``s`` copies the values into its module.

Cost: the leader holds a full copy of the model (the other stages' parameters stay on its
CPU) and every step moves each stage's gradients and values once over the pipeline group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tensorfleet.parallel.errors import ParallelConfigError, PipelineFailed


@dataclass(frozen=True)
class StageControl:
    """What the leader tells the stages after each update."""

    global_step: int
    stop: bool
    made_step: bool


class StageExchange:
    """The exchange between a pipeline's leader (group rank 0) and its other stages.

    Args:
        stage_params: for each stage, the names of its parameters (from
            ``split_stages(model, ...)``: the stages keep the model's names).
        stage_index: this task's stage.
        params: this task's parameters by name: the whole model's on the leader, this
            stage's elsewhere.
        group: the pipeline's process group (None: the default group).
        stage_names: for messages, e.g. ``["stage 0 (worker:0)", "stage 1 (stage:0)"]``.
    """

    def __init__(
        self,
        stage_params: Sequence[Sequence[str]],
        stage_index: int,
        params: dict[str, torch.Tensor],
        *,
        group: dist.ProcessGroup | None = None,
        stage_names: Sequence[str] | None = None,
    ) -> None:
        self.stage_params = [list(names) for names in stage_params]
        self.stage_index = stage_index
        self.group = group
        self.names = list(stage_names or [f"stage {i}" for i in range(len(stage_params))])
        mine = range(len(stage_params)) if stage_index == 0 else [stage_index]
        missing = [n for s in mine for n in self.stage_params[s] if n not in params]
        if missing:
            raise ParallelConfigError(
                f"{self.names[stage_index]} lacks parameters {missing[:5]} of the stages it "
                "exchanges: the leader needs the whole model, every other stage its own slice"
            )
        self.params = params

    @property
    def is_leader(self) -> bool:
        return self.stage_index == 0

    def gather_gradients(self) -> None:
        """Stages send their gradients; the leader receives them into its model's ``.grad``."""
        if self.is_leader:
            for s in range(1, len(self.stage_params)):
                for flat, tensors in self._flats(s, grads=True, allocate=True):
                    self._recv(flat, s, "gradients")
                    _unflatten(flat, tensors)
        else:
            for flat, _ in self._flats(self.stage_index, grads=True, allocate=False):
                self._send(flat, 0, "gradients")

    def scatter_values(self, control: StageControl | None = None) -> StageControl:
        """The leader sends each stage its new parameter values and ``control``; the stages
        receive them into their parameters. Returns the control on every stage."""
        vector = torch.zeros(3, dtype=torch.int64)
        if self.is_leader:
            if control is None:
                raise ParallelConfigError("the leader must give the control to scatter")
            vector = torch.tensor(
                [control.global_step, int(control.stop), int(control.made_step)], dtype=torch.int64
            )
            for s in range(1, len(self.stage_params)):
                for flat, _ in self._flats(s, grads=False, allocate=False):
                    self._send(flat, s, "parameter values")
                self._send(vector, s, "the control vector")
            return control
        for flat, tensors in self._flats(self.stage_index, grads=False, allocate=True):
            self._recv(flat, 0, "parameter values")
            with torch.no_grad():
                for t, piece in zip(tensors, _pieces(flat, tensors), strict=True):
                    t.copy_(piece)
        self._recv(vector, 0, "the control vector")
        return StageControl(int(vector[0]), bool(vector[1]), bool(vector[2]))

    # -- helpers -----------------------------------------------------------------------------

    def _flats(
        self, stage: int, *, grads: bool, allocate: bool
    ) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """One flat CPU buffer per dtype of ``stage``'s parameters (or their gradients), with
        the tensors it covers. ``allocate``: an empty buffer to receive into; else the data."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for name in self.stage_params[stage]:
            param = self.params[name]
            by_dtype.setdefault(param.dtype, []).append(param)
        out = []
        for dtype, tensors in by_dtype.items():
            numel = sum(t.numel() for t in tensors)
            if allocate:
                out.append((torch.empty(numel, dtype=dtype), tensors))
                continue
            sources = []
            for t in tensors:
                source = t.grad if grads else t.detach()
                if source is None:
                    source = torch.zeros_like(t)
                sources.append(source.reshape(-1).cpu())
            out.append((torch.cat(sources), tensors))
        return out

    def _send(self, tensor: torch.Tensor, stage: int, what: str) -> None:
        try:
            dist.send(tensor.contiguous(), group=self.group, group_dst=stage)
        except Exception as exc:
            raise self._failure(stage, f"sending {what} to", exc) from exc

    def _recv(self, tensor: torch.Tensor, stage: int, what: str) -> None:
        try:
            dist.recv(tensor, group=self.group, group_src=stage)
        except Exception as exc:
            raise self._failure(stage, f"receiving {what} from", exc) from exc

    def _failure(self, peer: int, doing: str, exc: Exception) -> PipelineFailed:
        return PipelineFailed(
            f"{self.names[self.stage_index]} failed {doing} {self.names[peer]}: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}. {self.names[peer]} "
            "probably stopped or died; look at its output"
        )


def _pieces(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Put the received gradients into ``tensors``' ``.grad`` (on each tensor's device)."""
    for t, piece in zip(tensors, _pieces(flat, tensors), strict=True):
        t.grad = piece.to(t.device).clone() if t.device.type != "cpu" else piece.clone()


def stage_parameter_names(stages: Sequence[nn.Module]) -> list[list[str]]:
    """Each stage's trainable parameter names (the model's names, as ``split_stages`` keeps)."""
    return [[n for n, p in stage.named_parameters() if p.requires_grad] for stage in stages]
