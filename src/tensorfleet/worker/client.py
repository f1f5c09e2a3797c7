"""The worker's side of the parameter servers: one channel per shard, fused buffers, every
shard in parallel.

A training step is one round trip per shard: the gradients of that shard's variables go out
as one buffer per dtype and the new values come back in the reply (``push`` with
``want_values``), so a step costs one latency, not two. All shards are sent to before any is
waited on, so the transfers overlap.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import zmq

from tensorfleet.errors import DeadlineExceeded
from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.version import __version__
from tensorfleet.wire.message import PROTOCOL_VERSION, Limits
from tensorfleet.wire.tensors import DTYPES, as_buffer, from_buffer
from tensorfleet.wire.transport import Channel, Reply

log = logging.getLogger("tensorfleet.worker")

#: Extra seconds a client waits beyond a request's own deadline for the server's explanation.
ANSWER_MARGIN_S = 2.0


@dataclass(frozen=True)
class ClientTimeouts:
    """Deadlines of the worker's waits on the parameter servers, in seconds."""

    connect_s: float = 60.0
    """For every ps to answer ``hello`` (they may still be starting)."""
    initialize_s: float = 300.0
    """For the chief to create the variables (a non-chief waits this long)."""
    step_s: float = 120.0
    """For one push+pull round trip."""

    def __post_init__(self) -> None:
        for name in ("connect_s", "initialize_s", "step_s"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"ClientTimeouts.{name} must be positive, got {getattr(self, name)}"
                )


@dataclass(frozen=True)
class Progress:
    """What the parameter servers said about training after a pull or push."""

    global_step: int
    stop: bool
    """The chief has declared training over."""
    made_step: bool = True
    """This worker's push completed the global step (exactly one worker per step)."""
    dropped: bool = False
    """sync: this worker's gradients came too late for their step and were dropped."""


@dataclass(frozen=True)
class _Member:
    """One model tensor (or a row range of it) inside one shard's fused buffer."""

    param: torch.Tensor
    row_start: int
    row_stop: int
    whole: bool
    offset: int
    numel: int


class ParameterClient:
    """Pulls variables from and pushes gradients to every ps shard.

    Lifecycle: :meth:`connect`, :meth:`register` (the chief creates, the others wait for
    that), then :meth:`pull` / :meth:`push_pull` each step, and :meth:`finish`.
    Not thread-safe: one training thread owns it.
    """

    def __init__(
        self,
        ps_addresses: Sequence[str],
        secret: bytes,
        task_name: str,
        timeouts: ClientTimeouts | None = None,
        limits: Limits | None = None,
        encrypt: bool = False,
    ) -> None:
        if not ps_addresses:
            raise ValueError("a ParameterClient needs at least one ps address")
        self.task_name = task_name
        self.timeouts = timeouts or ClientTimeouts()
        self._context = zmq.Context(io_threads=1)
        self._channels = [
            Channel(
                address, secret, f"ps:{i}", limits=limits, context=self._context, encrypt=encrypt
            )
            for i, address in enumerate(ps_addresses)
        ]
        self._members: list[list[list[_Member]]] = []  # shard -> group -> members
        self._layouts: list[FusedLayout] = []
        self._send_buffers: list[list[torch.Tensor]] = []
        self._variable_names: dict[str, str] = {}

    @property
    def num_shards(self) -> int:
        return len(self._channels)

    def connect(self) -> None:
        """Say hello to every shard (checks versions and the secret)."""
        body = {"protocol": PROTOCOL_VERSION, "version": __version__, "task": self.task_name}
        self._all("hello", [body] * self.num_shards, None, self.timeouts.connect_s)

    def register(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        plan: PlacementPlan,
        rule: UpdateRule,
        is_chief: bool,
        discipline: UpdateDiscipline | None = None,
    ) -> int:
        """Bind the model's parameters to the plan. The chief creates the variables with its
        current values (idempotent: if they exist already, it adopts them); everyone else
        waits until they exist and checks that its model matches. Returns the global step."""
        if plan.num_shards != self.num_shards:
            raise ValueError(
                f"placement plan for {plan.num_shards} shards, but the cluster has {self.num_shards} ps tasks"
            )
        params = dict(named_params)
        self._layouts, self._members, self._send_buffers = [], [], []
        self._variable_names = {
            s.stored_name: s.variable.name for shard in plan.shards for s in shard
        }
        for shard in plan.shards:
            layout = FusedLayout.of(
                [StoredVariable(s.stored_name, s.shape, s.variable.dtype) for s in shard]
            )
            by_name = {s.stored_name: s for s in shard}
            groups = []
            for group in layout.groups:
                members = []
                for var, offset in group.members:
                    piece = by_name[var.name]
                    members.append(
                        _Member(
                            params[piece.variable.name],
                            piece.row_start,
                            piece.row_stop,
                            piece.is_whole,
                            offset,
                            var.numel,
                        )
                    )
                groups.append(members)
            self._layouts.append(layout)
            self._members.append(groups)
            self._send_buffers.append(
                [torch.empty(g.numel, dtype=DTYPES[g.dtype]) for g in layout.groups]
            )

        variables = [[v.to_wire() for v in layout.variables] for layout in self._layouts]
        if is_chief:
            bodies = [
                {
                    "variables": variables[i],
                    "rule": rule.to_wire(),
                    "owns_global_step": i == 0,
                    "discipline": (discipline or UpdateDiscipline()).to_wire(),
                }
                for i in range(self.num_shards)
            ]
            buffers = [self._gather(i, values=True) for i in range(self.num_shards)]
            replies = self._all("create", bodies, buffers, self.timeouts.connect_s)
            if not replies[0].body.get("created"):
                log.info("%s: variables already exist on the ps; adopting them", self.task_name)
        else:
            bodies = [
                {"variables": variables[i], "task": self.task_name} for i in range(self.num_shards)
            ]
            try:
                replies = self._all("wait_ready", bodies, None, self.timeouts.initialize_s)
            except DeadlineExceeded as exc:
                raise DeadlineExceeded(
                    f"{self.task_name}: the chief has not initialized the variables within "
                    f"{self.timeouts.initialize_s:.0f} s ({exc}). Is the chief (worker 0) running? "
                    "Its output says why it has not."
                ) from None
        return int(replies[0].body.get("global_step", 0))

    def pull(self) -> Progress:
        """Bring the current values of every variable into the model."""
        replies = self._all("pull", [{}] * self.num_shards, None, self.timeouts.step_s)
        self._scatter_values(replies)
        return self._progress(replies)

    def push_pull(self, count_step: bool = True, step: int | None = None) -> Progress:
        """Send the model's gradients to every shard and bring the values returned into the
        model: one round trip per shard, all shards at once."""
        bodies = [
            {
                "count_step": count_step and i == 0,
                "want_values": True,
                "task": self.task_name,
                "step": step,
            }
            for i in range(self.num_shards)
        ]
        buffers = [self._gather(i, values=False) for i in range(self.num_shards)]
        replies = self._all("push", bodies, buffers, self.timeouts.step_s)
        self._scatter_values(replies)
        return self._progress(replies)

    def moving_average(self) -> dict[str, torch.Tensor]:
        """The moving average the shards keep, as fresh tensors by parameter name."""
        bodies = [{"moving_average": True}] * self.num_shards
        replies = self._all("pull", bodies, None, self.timeouts.step_s)
        averages: dict[str, torch.Tensor] = {}
        for shard, reply in enumerate(replies):
            layout = self._layouts[shard]
            for group, members, buffer in zip(
                layout.groups, self._members[shard], reply.buffers, strict=True
            ):
                flat = from_buffer(buffer, DTYPES[group.dtype], (group.numel,))
                for m, (var, _) in zip(members, group.members, strict=True):
                    name = self._variable_names[var.name]
                    target = averages.setdefault(
                        name, torch.empty(m.param.shape, dtype=m.param.dtype)
                    )
                    piece = target if m.whole else target[m.row_start : m.row_stop]
                    piece.copy_(flat[m.offset : m.offset + m.numel].view(piece.shape))
        return averages

    def finish(self, declare_end: bool) -> None:
        """Tell every shard this worker is done (the chief first declares training over)."""
        if declare_end:
            self._all("end", [{}] * self.num_shards, None, self.timeouts.connect_s)
        self._all(
            "done", [{"task": self.task_name}] * self.num_shards, None, self.timeouts.connect_s
        )

    def stats(self) -> list[dict]:
        """Each shard's counters (pushes, rejected messages, ...)."""
        return [
            r.body
            for r in self._all("stats", [{}] * self.num_shards, None, self.timeouts.connect_s)
        ]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._context.term()

    # -- internals ------------------------------------------------------------------------------

    def _all(
        self, op: str, bodies: list[dict], buffers: list[list] | None, timeout_s: float
    ) -> list[Reply]:
        ids = [
            ch.send(op, body, buffers[i] if buffers else None, timeout_s)
            for i, (ch, body) in enumerate(zip(self._channels, bodies, strict=True))
        ]
        # A ps gives up on a request it holds at timeout_s and says why; wait a little longer
        # than that, so that its explanation, not a bare timeout, is what the user sees.
        return [
            ch.wait(request_id, timeout_s + ANSWER_MARGIN_S)
            for ch, request_id in zip(self._channels, ids, strict=True)
        ]

    def _gather(self, shard: int, values: bool) -> list[memoryview]:
        """Pack the shard's values or gradients into its send buffers (one copy per tensor)."""
        out = []
        for members, flat in zip(self._members[shard], self._send_buffers[shard], strict=True):
            pieces = []
            for m in members:
                source = m.param.detach() if values else m.param.grad
                if source is None:
                    source = torch.zeros_like(m.param)
                if not m.whole:
                    source = source[m.row_start : m.row_stop]
                pieces.append(source.reshape(-1).cpu())  # a copy only for GPU tensors
            torch.cat(pieces, out=flat)
            out.append(as_buffer(flat))
        return out

    def _scatter_values(self, replies: list[Reply]) -> None:
        with torch.no_grad():
            for shard, reply in enumerate(replies):
                layout = self._layouts[shard]
                if len(reply.buffers) != len(layout.groups):
                    raise RuntimeError(
                        f"ps:{shard} sent {len(reply.buffers)} value buffers, expected {len(layout.groups)}"
                    )
                for group, members, buffer in zip(
                    layout.groups, self._members[shard], reply.buffers, strict=True
                ):
                    flat = from_buffer(buffer, DTYPES[group.dtype], (group.numel,))
                    for m in members:
                        values = flat[m.offset : m.offset + m.numel]
                        if m.whole and m.param.device.type == "cpu":
                            # Adopt the received memory as the parameter's storage: no copy.
                            # The tensor keeps the received frame alive; nothing else uses it.
                            m.param.data = values.view(m.param.shape)
                        else:
                            target = m.param if m.whole else m.param[m.row_start : m.row_stop]
                            target.copy_(values.view(target.shape))  # to the GPU, or into a slice

    @staticmethod
    def _progress(replies: list[Reply]) -> Progress:
        return Progress(
            global_step=int(replies[0].body.get("global_step", 0)),
            stop=any(r.body.get("stop") is True for r in replies),
            made_step=replies[0].body.get("made_step", True) is True,
            dropped=any(r.body.get("dropped") is True for r in replies),
        )
