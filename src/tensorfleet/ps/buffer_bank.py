"""A ps shard's persistent buffers (BatchNorm's running statistics, ``num_batches_tracked``,
any buffer a model registers as persistent) and the three requests that serve them.

Buffers are model state that no gradient trains: each worker updates its copy in the forward
pass, pushes it after its step, and takes back the value the shard holds, combined by the
buffer's :mod:`~tensorfleet.ps.buffer_policies` policy. Buffers travel in requests of their
own rather than inside a gradient push so that the gradient path (the fused buffers, the sync
aggregator, the staleness gate) stays as it is; the cost is one more round trip per step,
only for models that have buffers.

=================  =====================================================================
``buffers_create`` names, dtypes, shapes, initial values (the chief's) -> the shard's values.
                   Idempotent: values that exist (an earlier create, a checkpoint) win. A
                   worker other than the chief (``"chief": false``) is held until the
                   chief's create arrived, so every worker starts from the chief's values.
``buffers_push``   a worker's values after step ``step`` -> the shard's values.
                   async: combined at once (``latest`` by default). sync: held until every
                   worker whose gradients made step ``step`` (as the sync step recorded them,
                   :meth:`BufferBank.step_made`) has pushed, then combined over those
                   pushes (``mean`` by default) and answered to all of them. A push from a
                   worker that did not make that step (its gradients were dropped as stale)
                   changes nothing and gets the shard's values.
``buffers_pull``   -> the shard's values.
=================  =====================================================================

The values are part of the shard's checkpoint document (``buffer/<name>``), so a checkpoint
restores them and a ps restarted from a checkpoint serves them at once, without waiting for
a create (:meth:`BufferBank.take_checkpoint`). Requests name their buffers; the order of the
names is the requester's (a checkpoint lists them in its own order), and a shard answers in
it. A pull or push that reaches a shard with no buffers yet (restarted without a checkpoint)
is held until the chief's create, which its recovery sends again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tensorfleet.errors import ConfigError, ProtocolError, RemoteError, refusal_code
from tensorfleet.ps.buffer_policies import BufferPolicy, combine, resolve_policies
from tensorfleet.wire.service_socket import Request, ServiceSocket
from tensorfleet.wire.tensors import as_buffer, dtype_name, from_buffer, parse_dtype, parse_shape

MAX_BUFFERS_PER_SHARD = 100_000
_STEPS_KEPT = 8
"""How many recent sync steps' contributors are remembered (a worker pushes its buffers
right after its step, so only the newest few matter)."""


class BufferBank:
    """The persistent buffers held by one shard and their combining rules.

    ``reply`` answers a request on the shard's socket; ``departed()`` names the workers a sync
    step no longer waits for (done, or lost when the discipline shrinks)."""

    def __init__(
        self,
        socket: ServiceSocket,
        num_workers: int,
        departed: Callable[[], set[str]],
    ) -> None:
        self.socket = socket
        self.num_workers = num_workers
        self.departed = departed
        self.mode = "async"
        self.values: dict[str, torch.Tensor] = {}
        self.policies: dict[str, BufferPolicy] = {}
        self._created = False
        self._waiting_for_create: list[Request] = []
        self._contributors: dict[int, set[str]] = {}
        self._pending: dict[int, dict[str, list[torch.Tensor]]] = {}
        self._held: dict[int, list[Request]] = {}
        self.counters = {"buffer_pushes": 0, "buffer_pushes_ignored": 0}

    def handlers(self) -> dict[str, Callable[[Request], None]]:
        """The requests this bank answers, by operation name."""
        return {
            "buffers_create": self._create,
            "buffers_push": self._push,
            "buffers_pull": self._pull,
        }

    # -- what the service tells the bank -------------------------------------------------------

    def step_made(self, step: int, tasks: list[str]) -> None:
        """Sync mode: the gradients of ``tasks`` made step ``step``; their buffer pushes for
        that step are the ones combined."""
        self._contributors[step] = set(tasks)
        for old in [s for s in self._contributors if s <= step - _STEPS_KEPT]:
            del self._contributors[old]
            self._pending.pop(old, None)
            for request in self._held.pop(old, []):
                self._reply(request, self._known_names(request))
        self._release(step)

    def take_checkpoint(self, buffers: dict[str, torch.Tensor], mode: str) -> None:
        """Hold ``buffers`` (a checkpoint's): they win over any create, and are served at
        once, combined as ``mode`` (the shard's update mode) says: a restarted shard that
        was restored answers the workers' pulls before any create comes again."""
        self.values.update({name: tensor.clone() for name, tensor in buffers.items()})
        if not buffers:
            return
        self.mode = mode
        self.policies.update(resolve_policies({name: t.dtype for name, t in buffers.items()}, mode))
        self._created = True
        self._serve_waiting()

    # -- requests ------------------------------------------------------------------------------

    def _create(self, request: Request) -> None:
        names, dtypes, shapes = _described(request.body)
        if len(request.buffers) != len(names):
            raise ProtocolError(
                f"buffers_create: {len(request.buffers)} values for {len(names)} buffers"
            )
        mode = request.body.get("mode", "async")
        if mode not in ("async", "sync"):
            raise ProtocolError(f"buffers_create: mode must be 'async' or 'sync', got {mode!r}")
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            held = self.values.get(name)
            if held is not None and (held.dtype != dtype or tuple(held.shape) != shape):
                raise ConfigError(
                    f"buffer {name!r} is {held.dtype} {list(held.shape)} on this shard, the "
                    f"model has {dtype} {list(shape)}; fix: give every worker the same model, or "
                    "start from another checkpoint directory"
                )
        if request.body.get("chief") is not True and not self._created:
            self._waiting_for_create.append(request)
            return
        missing = {n: d for n, d in zip(names, dtypes, strict=True) if n not in self.values}
        if not self._created or missing:
            if not self._created:
                self.mode = mode
            self.policies.update(resolve_policies(missing, self.mode))
            for name, dtype, shape, raw in zip(names, dtypes, shapes, request.buffers, strict=True):
                if name in missing:  # a checkpoint's value wins
                    self.values[name] = from_buffer(raw, dtype, shape).clone()
            self._created = True
        self._reply(request, names)
        self._serve_waiting()

    def _serve_waiting(self) -> None:
        """The requests held until the shard had buffers, served now (one refused gets its
        refusal; the others are served all the same)."""
        waiting, self._waiting_for_create = self._waiting_for_create, []
        handlers = self.handlers()
        for waiter in waiting:
            try:
                handlers[waiter.op](waiter)
            except (RemoteError, ProtocolError, ValueError) as exc:
                self.socket.fail(waiter, refusal_code(exc), str(exc))

    def _push(self, request: Request) -> None:
        if not self._created:
            self._waiting_for_create.append(request)
            return
        names = self._known_names(request)
        if len(request.buffers) != len(names):
            raise ProtocolError(f"buffers_push: {len(request.buffers)} values for {len(names)}")
        pushed = {
            name: from_buffer(raw, self.values[name].dtype, tuple(self.values[name].shape))
            for name, raw in zip(names, request.buffers, strict=True)
        }
        task = request.body.get("task")
        if self.mode == "async":
            for name, value in pushed.items():
                self.values[name] = combine(
                    name, self.policies[name], self.values[name], [value], self.num_workers
                )
            self.counters["buffer_pushes"] += 1
            self._reply(request, names)
            return
        step = request.body.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ProtocolError(f"a sync buffers_push needs the integer 'step', got {step!r}")
        if task not in self._contributors.get(step, set()):
            self.counters["buffer_pushes_ignored"] += 1
            self._reply(request, names)
            return
        self._pending.setdefault(step, {})[task] = {n: v.clone() for n, v in pushed.items()}
        self._held.setdefault(step, []).append(request)
        self._release(step)

    def _pull(self, request: Request) -> None:
        if not self._created:
            self._waiting_for_create.append(request)
            return
        self._reply(request, self._known_names(request))

    # -- internals -----------------------------------------------------------------------------

    def _release(self, step: int) -> None:
        """Combine step ``step`` once every worker that made it (and has not departed) pushed."""
        pending = self._pending.get(step)
        if not pending:
            return
        expected = self._contributors.get(step, set()) - self.departed()
        if not expected <= set(pending):
            return
        order = sorted(pending)
        for name in pending[order[0]]:  # every worker of a model pushes the same buffers
            self.values[name] = combine(
                name,
                self.policies[name],
                self.values[name],
                [pending[task][name] for task in order if name in pending[task]],
                self.num_workers,
            )
        self.counters["buffer_pushes"] += len(order)
        del self._pending[step]
        for request in self._held.pop(step, []):
            self._reply(request, self._known_names(request))

    def _known_names(self, request: Request) -> list[str]:
        """The buffers a request names, in its order (all the shard's when it names none)."""
        names = request.body.get("names")
        if names is None:
            return list(self.values)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ProtocolError(f"'names' must be a list of strings, got {names!r}")
        unknown = [name for name in names if name not in self.values]
        if unknown:
            raise ConfigError(
                f"buffers {unknown} are not on this shard (it holds {sorted(self.values)}); "
                "fix: give every worker the same model"
            )
        return names

    def _reply(self, request: Request, names: list[str] | None = None) -> None:
        names = list(self.values) if names is None else names
        self.socket.reply(
            request,
            {"names": names},
            [as_buffer(self.values[name].contiguous()) for name in names],
        )


def _described(body: dict[str, Any]) -> tuple[list[str], list[torch.dtype], list[tuple]]:
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (
        isinstance(names, list)
        and isinstance(dtypes, list)
        and isinstance(shapes, list)
        and len(names) == len(dtypes) == len(shapes) <= MAX_BUFFERS_PER_SHARD
        and all(isinstance(n, str) and n for n in names)
        and len(set(names)) == len(names)
    ):
        raise ProtocolError(
            "buffers_create needs lists 'names' (unique strings), 'dtypes' and 'shapes' of one "
            f"length (at most {MAX_BUFFERS_PER_SHARD})"
        )
    return names, [parse_dtype(d) for d in dtypes], [parse_shape(s) for s in shapes]


def describe(buffers: dict[str, torch.Tensor]) -> dict[str, list]:
    """The ``names``/``dtypes``/``shapes`` of a ``buffers_create`` body."""
    return {
        "names": list(buffers),
        "dtypes": [dtype_name(b.dtype) for b in buffers.values()],
        "shapes": [list(b.shape) for b in buffers.values()],
    }
