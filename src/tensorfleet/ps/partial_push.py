"""Partial pushes: the gradients of part of a shard's variables (one *bucket*), applied as
soon as they arrive, so that a worker can push while its backward pass still runs
(:mod:`tensorfleet.worker.bucketed_push`). A mixin of
:class:`~tensorfleet.ps.service.ParameterService`.

A partial push is a ``push`` whose body names ``part: [start, stop]``, a contiguous range of
the shard's variables in layout order, and ``last``, whether it is the worker's last bucket
of the step for this shard. Its buffers are that range's slice of each dtype group (one per
group, empty for a group with none of its variables: :meth:`FusedLayout.part_slices`), and
the reply carries the same slices of the new values.

Rule. Only in ``async`` mode without ``max_staleness``: the sync step averages whole
gradients and the staleness gate counts whole steps, so there a partial push is refused
(:class:`~tensorfleet.errors.RequestRefused`, naming the mode). A worker that declared a bf16
wire (``wire_dtype="bf16"``) sends each bucket's float32 slices as bf16, encoded with its
error feedback element by element (:mod:`tensorfleet.wire.gradient_encoding`), and they are
upcast here. Everything is checked before anything changes (never trust bytes): the range
must be two integers with ``0 <= start < stop <=`` the number of variables, the buffers one
per dtype group, each exactly the bytes of its slice in the declared wire dtype, the push's
wire dtype the one the worker declared; ``count_step`` only with ``last``. Anything else is
refused with :class:`~tensorfleet.errors.ProtocolError` and the shard goes on serving. A
bucket whose gradient is too old (its ``based_on``, :mod:`tensorfleet.ps.gradient_age`) is
judged like a whole push: answered ``dropped`` with the part's current values, nothing
applied; a dropped ``last`` bucket leaves ``version`` and the global step where they are.

Invariant. A worker step pushed in buckets that cover each variable once moves the shard
exactly as the whole push would: the store steps only the part's variables (``torch.optim``
skips a parameter without a gradient, so Adam's per-variable step counts advance once per
step) and updates only the part's moving average; ``version``, ``pushes`` and the global
step advance once per step, with the ``last`` bucket (the global step only on the shard that
owns it, and only when ``count_step`` says so, as for a whole push).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorfleet.errors import ProtocolError, RequestRefused
from tensorfleet.ps.layout import FusedLayout
from tensorfleet.ps.shard_checkpoint import check_worker_data
from tensorfleet.wire.gradient_encoding import travel_dtype
from tensorfleet.wire.tensors import DTYPES, from_buffer

if TYPE_CHECKING:
    from collections import Counter

    from tensorfleet.ps.spans import SpanRecorder
    from tensorfleet.ps.staleness_gate import StalenessGate
    from tensorfleet.ps.store import VariableStore
    from tensorfleet.ps.sync_aggregator import SyncAggregator
    from tensorfleet.wire.gradient_encoding import GradientDecoder
    from tensorfleet.wire.service_socket import Request, ServiceSocket


def parse_part(part: object, layout: FusedLayout) -> tuple[int, int]:
    """``part`` as ``(start, stop)`` after checking it against ``layout`` (ProtocolError)."""
    count = len(layout.variables)
    if (
        not isinstance(part, list)
        or len(part) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in part)
    ):
        raise ProtocolError(
            f"'part' must be [start, stop], two integers (a range of the shard's {count} "
            f"variables), got {part!r}"
        )
    start, stop = part
    if not 0 <= start < stop <= count:
        raise ProtocolError(
            f"'part' [{start}, {stop}] is not a range of this shard's variables: it needs "
            f"0 <= start < stop <= {count}"
        )
    return start, stop


def part_gradients(
    layout: FusedLayout, start: int, stop: int, buffers: list, wire_dtype: str | None = None
) -> list[torch.Tensor]:
    """The received buffers of the part ``[start, stop)`` as one flat tensor per group in the
    variables' dtypes, after checking their count and their sizes in the worker's declared
    ``wire_dtype`` (ProtocolError naming the group); float32 sent as bf16 is upcast."""
    if len(buffers) != len(layout.groups):
        raise ProtocolError(
            f"a push of variables [{start}, {stop}) has {len(buffers)} buffers, the shard has "
            f"{len(layout.groups)} dtype groups (one buffer each, empty where the part has none)"
        )
    tensors = []
    for group, (lo, hi), buffer in zip(
        layout.groups, layout.part_slices(start, stop), buffers, strict=True
    ):
        sends = travel_dtype(group.dtype, wire_dtype)
        expected = (hi - lo) * DTYPES[sends].itemsize
        nbytes = memoryview(buffer).nbytes
        if nbytes != expected:
            sent_as = f" (sent as {sends})" if sends != group.dtype else ""
            raise ProtocolError(
                f"a push of variables [{start}, {stop}): the {group.dtype} buffer{sent_as} has "
                f"{nbytes} bytes, those variables need {expected}"
            )
        received = from_buffer(buffer, DTYPES[sends])
        tensors.append(received if sends == group.dtype else received.to(DTYPES[group.dtype]))
    return tensors


class PartialPushHandling:
    """A shard's partial pushes, mixed into ``ParameterService`` (see the module), which
    provides the attributes below and ``_worker_of`` / ``_progress``."""

    socket: ServiceSocket
    store: VariableStore
    aggregator: SyncAggregator | None
    gate: StalenessGate | None
    stats: Counter[str]
    global_step: int
    owns_global_step: bool
    worker_data: dict[str, dict]
    spans: SpanRecorder
    gradient_decoder: GradientDecoder

    def _push_part(self, request: Request, based_on: int | None) -> None:
        """Apply a bucket of a worker's step and answer with its new values (``based_on``: the
        version its gradient was computed on, read and checked by the service's ``_push``)."""
        body = request.body
        if self.aggregator is not None or self.gate is not None:
            mode = "sync" if self.aggregator is not None else "async with max_staleness"
            raise RequestRefused(
                f"a push of part of the variables (a bucket) in mode {mode}: those modes take "
                "one whole push per step; only plain async pushes buckets during the backward"
            )
        wire_dtype = self.gradient_decoder.check_claim(body.get("task"), body.get("gradient_dtype"))
        layout = self.store.layout
        start, stop = parse_part(body.get("part"), layout)
        last, counting = body.get("last", False), body.get("count_step", False)
        if not isinstance(last, bool) or not isinstance(counting, bool):
            raise ProtocolError(
                f"'last' and 'count_step' must be booleans, got {last!r}, {counting!r}"
            )
        if counting and not last:
            raise ProtocolError(
                "'count_step' on a bucket that is not the last of its step: the global step "
                "advances once per worker step"
            )
        gradients = part_gradients(layout, start, stop, request.buffers, wire_dtype)
        data = body.get("data")
        if data is not None:
            if not last:
                raise ProtocolError("a data position goes with the last bucket of a step only")
            task = self._worker_of(request)  # type: ignore[attr-defined]
            self.worker_data[task] = check_worker_data(task, data)
        if not self._young_enough(request, based_on):  # type: ignore[attr-defined]
            self._answer_part(request, layout.part_slices(start, stop), dropped=True)
            return
        step_after = self.global_step + (1 if last and self.owns_global_step and counting else 0)
        with (
            self._logging_push(gradients, body, step_after, part=(start, stop), counts=last),  # type: ignore[attr-defined]
            self.spans.span("apply", variables=f"{start}-{stop}", task=str(body.get("task"))),
        ):
            self.store.apply(gradients, part=(start, stop), counts=last)
        self.global_step = step_after
        self.stats["buckets"] += 1
        if last:
            self.stats["pushes"] += 1
        with self.spans.span("reply", variables=f"{start}-{stop}"):
            self._answer_part(request, layout.part_slices(start, stop))

    def _answer_part(
        self, request: Request, slices: list[tuple[int, int]], dropped: bool = False
    ) -> None:
        """The reply to a bucket: progress and, when asked, the part's new values (``dropped``:
        too old to apply, :mod:`tensorfleet.ps.gradient_age`)."""
        reply = {**self._progress(), "made_step": not dropped, "dropped": dropped}  # type: ignore[attr-defined]
        if request.body.get("want_values") is not True:
            self.socket.reply(request, reply)
            return
        parts = [
            flat[lo:hi] for flat, (lo, hi) in zip(self.store.live_values(), slices, strict=True)
        ]
        self._reply_from_store(request, reply, parts, slices)  # type: ignore[attr-defined]
