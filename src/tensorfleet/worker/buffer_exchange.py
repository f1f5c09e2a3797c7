"""A worker's side of the persistent buffers in the parameter-server modes: where each buffer
lives, and the requests that create, push and pull them (:mod:`tensorfleet.ps.buffer_bank`
is the shard's side).

Placement: a buffer goes to the shard that holds the first parameter of its module
(``bn.running_mean`` next to ``bn.weight``), so that a module's state stays on one shard; a
buffer of a module without parameters goes to the shard holding the fewest buffer bytes.

Each step, after the gradients' round trip, the worker pushes its buffers (updated by its
forward pass) and takes back the shard's combined value, so the next forward pass, the
chief's evaluation and every checkpoint use the shared value. In sync mode a worker whose
gradients were dropped as stale does not push its buffers for that step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tensorfleet.errors import ProtocolError
from tensorfleet.ps.buffer_bank import describe
from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.wire.channel import Reply
from tensorfleet.wire.tensors import as_buffer, from_buffer
from tensorfleet.worker.shard_fanout import ShardFanout


def place_buffers(plan: PlacementPlan, buffers: dict[str, torch.Tensor]) -> dict[str, int]:
    """The shard of each buffer: its module's first parameter's shard, else the shard with
    the fewest buffer bytes so far (ties: the lowest index)."""
    shard_of_param: dict[str, int] = {}
    for shard in plan.shards:
        for piece in shard:
            shard_of_param.setdefault(piece.variable.name, piece.shard)
    load = [0] * len(plan.shards)
    placement: dict[str, int] = {}
    for name, buffer in buffers.items():
        module = name.rpartition(".")[0]
        shard = next(
            (s for p, s in shard_of_param.items() if p.rpartition(".")[0] == module),
            None,
        )
        if shard is None:
            shard = min(range(len(load)), key=lambda i: load[i])
        placement[name] = shard
        load[shard] += buffer.numel() * buffer.element_size()
    return placement


def placement_report(placement: dict[str, int], buffers: dict[str, torch.Tensor]) -> str:
    """Lines for ``log_placement``: each buffer, its shard and size."""
    lines = [f"buffers: {len(buffers)} persistent buffer(s) on the ps"]
    for name, shard in placement.items():
        buffer = buffers[name]
        lines.append(
            f"  ps:{shard}  {name}  {list(buffer.shape)} {str(buffer.dtype).removeprefix('torch.')}"
            f"  {buffer.numel() * buffer.element_size()} bytes  (buffer)"
        )
    return "\n".join(lines)


class BufferExchange:
    """The persistent ``buffers`` of one worker's model, held on the shards by ``placement``.

    ``call(attempt)`` runs a fan-out (the client's recovering wrapper, so that a shard that
    restarts is recovered as for any request)."""

    def __init__(
        self,
        fanout: Callable[[], ShardFanout],
        call: Callable[[Callable[[], list[Reply]]], list[Reply]],
        buffers: dict[str, torch.Tensor],
        placement: dict[str, int],
        task_name: str,
        timeout_s: float,
    ) -> None:
        self._fanout = fanout
        self._call = call
        self.buffers = buffers
        self.placement = placement
        self.task_name = task_name
        self.timeout_s = timeout_s
        shards = sorted(set(placement.values()))
        self._shards = shards
        self._names = {s: [n for n, p in placement.items() if p == s] for s in shards}

    def create(self, mode: str, is_chief: bool) -> None:
        """The chief creates the buffers on their shards (a checkpoint's values win); every
        worker then takes the shards' values."""
        bodies = [
            {
                "task": self.task_name,
                "chief": is_chief,
                "mode": mode,
                **describe({n: self.buffers[n] for n in self._names[s]}),
            }
            for s in self._shards
        ]
        self._exchange("buffers_create", bodies, send=True)

    def push(self, step: int) -> None:
        """Push this worker's buffers after step ``step``; take back the combined values."""
        bodies = [
            {"task": self.task_name, "step": step, "names": self._names[s]} for s in self._shards
        ]
        self._exchange("buffers_push", bodies, send=True)

    def pull(self) -> None:
        """Take the shards' values."""
        bodies = [{"task": self.task_name, "names": self._names[s]} for s in self._shards]
        self._exchange("buffers_pull", bodies, send=False)

    def _exchange(self, op: str, bodies: list[dict], send: bool) -> None:
        if not self._shards:
            return
        values = {
            s: [self.buffers[n].detach().to("cpu").contiguous() for n in self._names[s]]
            for s in self._shards
        }
        frames: Sequence[Sequence[memoryview] | None] | None = (
            [[as_buffer(t) for t in values[s]] for s in self._shards] if send else None
        )
        replies = self._call(
            lambda: self._fanout().call(
                op, bodies, self.timeout_s, buffers=frames, shards=self._shards
            )
        )
        with torch.no_grad():
            for shard, reply in zip(self._shards, replies, strict=True):
                names = self._names[shard]
                if len(reply.buffers) != len(names):
                    raise ProtocolError(
                        f"ps:{shard} answered {op} with {len(reply.buffers)} buffers for "
                        f"{len(names)}"
                    )
                for name, raw in zip(names, reply.buffers, strict=True):
                    buffer = self.buffers[name]
                    buffer.copy_(from_buffer(raw, buffer.dtype, tuple(buffer.shape)))
