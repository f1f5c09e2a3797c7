"""``FusedParameters``: the model's parameters bound to the ps shards' fused buffers.

Each shard holds its variables (whole tensors, or row ranges of partitioned ones) as one
flat buffer per dtype (:class:`~tensorfleet.ps.layout.FusedLayout`), so a step sends one
buffer per dtype per shard instead of one message per tensor. This module packs the model's
values or gradients into those buffers (one copy per tensor, straight into a request's
shared-memory segment when the transport offers one) and unpacks the values that come
back into the model (none for whole CPU tensors: the received memory becomes the
parameter's storage). It knows nothing of the network; the client sends what it packs.

``part=(start, stop)`` packs or unpacks only the shard's variables ``[start, stop)``: one
bucket of a push made during the backward pass (each group's slice of
:meth:`~tensorfleet.ps.layout.FusedLayout.part_slices`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorfleet.errors import ConfigError, ProtocolError
from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.wire import value_encoding
from tensorfleet.wire.gradient_encoding import ErrorFeedback
from tensorfleet.wire.tensors import DTYPES, as_buffer, from_buffer


@dataclass(frozen=True)
class _Member:
    """One model tensor (or a row range of it) inside one shard's fused buffer."""

    param: torch.Tensor
    row_start: int
    row_stop: int
    whole: bool
    offset: int
    numel: int
    index: int
    """The variable's position in its shard's layout."""


class FusedParameters:
    """The binding of ``named_params`` to ``plan``'s shards: what to send, where to put
    what comes back."""

    def __init__(
        self, named_params: Sequence[tuple[str, torch.Tensor]], plan: PlacementPlan
    ) -> None:
        params = dict(named_params)
        missing = sorted({s.variable.name for shard in plan.shards for s in shard} - set(params))
        if missing:
            raise ConfigError(
                f"the placement plan names parameters the model does not have: {missing}"
            )
        self.layouts: list[FusedLayout] = []
        self._members: list[list[list[_Member]]] = []  # shard -> group -> members
        self._send_buffers: list[list[torch.Tensor]] = []
        self._variable_names = {
            s.stored_name: s.variable.name for shard in plan.shards for s in shard
        }
        for shard in plan.shards:
            layout = FusedLayout.of(
                [StoredVariable(s.stored_name, s.shape, s.variable.dtype) for s in shard]
            )
            by_name = {s.stored_name: s for s in shard}
            groups = []
            for group, indices in zip(layout.groups, layout.member_indices, strict=True):
                members = []
                for (var, offset), index in zip(group.members, indices, strict=True):
                    piece = by_name[var.name]
                    members.append(
                        _Member(
                            params[piece.variable.name],
                            piece.row_start,
                            piece.row_stop,
                            piece.is_whole,
                            offset,
                            var.numel,
                            index,
                        )
                    )
                groups.append(members)
            self.layouts.append(layout)
            self._members.append(groups)
            self._send_buffers.append(
                [torch.empty(g.numel, dtype=DTYPES[g.dtype]) for g in layout.groups]
            )

    @property
    def num_shards(self) -> int:
        return len(self.layouts)

    def variables(self, shard: int) -> list[dict[str, Any]]:
        """The shard's variables as the ps's ``create`` / ``wait_ready`` expect them."""
        return [v.to_wire() for v in self.layouts[shard].variables]

    def group_nbytes(self, shard: int, part: tuple[int, int] | None = None) -> list[int]:
        """The size in bytes of each of the shard's buffers (one per dtype group), or of
        each group's slice for the variables of ``part``."""
        if part is not None:
            return self.layouts[shard].part_bytes(*part)
        return [flat.numel() * flat.element_size() for flat in self._send_buffers[shard]]

    def variable_params(self, shard: int) -> list[torch.Tensor]:
        """The model parameter of each of the shard's variables, in layout order."""
        params: list[torch.Tensor | None] = [None] * len(self.layouts[shard].variables)
        for members in self._members[shard]:
            for m in members:
                params[m.index] = m.param
        return params  # type: ignore[return-value]  (every variable is some group's member)

    def _slices(self, shard: int, part: tuple[int, int] | None) -> list[tuple[int, int]]:
        if part is None:
            return [(0, flat.numel()) for flat in self._send_buffers[shard]]
        return self.layouts[shard].part_slices(*part)

    def gather(
        self,
        shard: int,
        values: bool,
        into: Sequence[memoryview] | None = None,
        part: tuple[int, int] | None = None,
    ) -> list[memoryview]:
        """Pack the shard's values or gradients (those of ``part``'s variables only, when
        given) into its buffers, one copy per tensor and no temporary (a missing gradient is
        sent as zeros). ``into``: writable byte buffers of :meth:`group_nbytes` (e.g. a
        request's shared-memory segment) to pack into instead of this object's own send
        buffers; returned as given. Values without ``into`` go into new buffers of their own
        (freed once the caller lets go of them), never into the send buffers: the send
        buffers stay unfaulted (not resident) until a push packs into them."""
        start, stop = part if part is not None else (0, len(self.layouts[shard].variables))
        slices = self._slices(shard, part)
        targets = [
            flat[lo:hi] for flat, (lo, hi) in zip(self._send_buffers[shard], slices, strict=True)
        ]
        if into is not None:
            targets = [
                self._writable_flat(buffer, flat)
                for buffer, flat in zip(into, targets, strict=True)
            ]
        elif values:
            # The values are gathered once, for the chief's create: into memory of their own,
            # freed once sent. Packed into the send buffers, they made those resident for the
            # worker's whole life (a copy of the model), though on one host no push uses
            # them (gradients go straight into shared memory).
            targets = [torch.empty_like(flat) for flat in targets]
        for members, flat, (lo, _) in zip(self._members[shard], targets, slices, strict=True):
            for m in members:
                if not start <= m.index < stop:
                    continue
                piece = flat[m.offset - lo : m.offset - lo + m.numel]
                source = m.param.detach() if values else m.param.grad
                if source is None:
                    piece.zero_()
                    continue
                if not m.whole:
                    source = source[m.row_start : m.row_stop]
                piece.view(source.shape).copy_(source)  # from the GPU too, without a temporary
        if into is not None:
            return list(into)
        return [as_buffer(flat) for flat in targets]

    def pack_gradients(
        self,
        shard: int,
        staging: Callable[[list[int]], list[memoryview] | None],
        encoder: ErrorFeedback | None = None,
    ) -> list[memoryview]:
        """The shard's gradients packed for a push: straight into the request segment that
        ``staging`` offers for these sizes (same host), else into the send buffers; with
        ``encoder``, in its wire dtype with error feedback."""
        if encoder is not None:
            gradients = self.gather(shard, values=False)
            return encoder.encode(shard, self.layouts[shard].groups, gradients, staging)
        return self.gather(shard, values=False, into=staging(self.group_nbytes(shard)))

    @staticmethod
    def _writable_flat(buffer: memoryview, like: torch.Tensor) -> torch.Tensor:
        """``buffer`` as a flat tensor of ``like``'s dtype and length (shares its memory)."""
        nbytes = like.numel() * like.element_size()
        if buffer.readonly or buffer.nbytes != nbytes:
            raise ConfigError(
                f"a buffer to gather into must be writable and {nbytes} bytes, got "
                f"{buffer.nbytes} bytes{' (read-only)' if buffer.readonly else ''}"
            )
        if nbytes == 0:
            return like[:0]
        return torch.frombuffer(buffer, dtype=like.dtype, count=like.numel())

    def scatter(
        self,
        shard: int,
        buffers: Sequence[Any],
        part: tuple[int, int] | None = None,
        values_dtype: str | None = None,
    ) -> None:
        """Put the values a shard sent (one buffer per dtype group; the slices of ``part``'s
        variables only, when given; float32 ones as ``values_dtype`` when given,
        :mod:`~tensorfleet.wire.value_encoding`) into the model."""
        layout = self.layouts[shard]
        self._check_count(shard, buffers)
        start, stop = part if part is not None else (0, len(layout.variables))
        with torch.no_grad():
            for group, members, buffer, (lo, hi) in zip(
                layout.groups, self._members[shard], buffers, self._slices(shard, part), strict=True
            ):
                dtype = value_encoding.travel_dtype(DTYPES[group.dtype], values_dtype)
                flat = from_buffer(buffer, dtype, (hi - lo,))
                for m in members:
                    if not start <= m.index < stop:
                        continue
                    values = flat[m.offset - lo : m.offset - lo + m.numel]
                    if _adoptable(m, values):
                        # Adopt the received memory as the parameter's storage: no copy.
                        # The tensor keeps the received frame alive; nothing else uses it.
                        m.param.data = values.view(m.param.shape)
                    else:
                        target = m.param if m.whole else m.param[m.row_start : m.row_stop]
                        target.copy_(values.view(target.shape))  # to the GPU, or into a slice

    def assemble(self, shard_buffers: Sequence[Sequence[Any]]) -> dict[str, torch.Tensor]:
        """Fresh tensors by parameter name from every shard's buffers (e.g. the moving
        average), leaving the model alone."""
        tensors: dict[str, torch.Tensor] = {}
        for shard, buffers in enumerate(shard_buffers):
            layout = self.layouts[shard]
            self._check_count(shard, buffers)
            for group, members, buffer in zip(
                layout.groups, self._members[shard], buffers, strict=True
            ):
                flat = from_buffer(buffer, DTYPES[group.dtype], (group.numel,))
                for m, (var, _) in zip(members, group.members, strict=True):
                    name = self._variable_names[var.name]
                    target = tensors.setdefault(
                        name, torch.empty(m.param.shape, dtype=m.param.dtype)
                    )
                    piece = target if m.whole else target[m.row_start : m.row_stop]
                    piece.copy_(flat[m.offset : m.offset + m.numel].view(piece.shape))
        return tensors

    def _check_count(self, shard: int, buffers: Sequence[Any]) -> None:
        expected = len(self.layouts[shard].groups)
        if len(buffers) != expected:
            raise ProtocolError(
                f"ps:{shard} sent {len(buffers)} value buffers, expected {expected}"
            )


def _adoptable(member: _Member, values: torch.Tensor) -> bool:
    """Whether ``values`` can become ``member``'s storage as they are: a whole CPU tensor of
    its dtype whose strides are the contiguous ones. A parameter with other strides
    (channels-last, including one input channel, where they differ from NCHW's only in a
    size-1 dimension) is copied into instead and keeps them."""
    param = member.param
    return (
        member.whole
        and param.device.type == "cpu"
        and param.dtype == values.dtype
        and param.stride() == values.view(param.shape).stride()
    )
