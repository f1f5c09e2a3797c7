"""How a push's gradients travel: in their variables' dtype (the default), or float32
gradients as bfloat16 with error feedback (``TrainingSession(..., wire_dtype="bf16")``).

The format, one rule for both ends: with wire dtype ``"bf16"`` every float32 group of a
shard's fused layout is sent as bfloat16 (round to nearest even), half the bytes; groups of
any other dtype travel as they are. The worker says which wire dtype it uses in its hello
and in every push; the ps (:class:`GradientDecoder`) refuses a push whose wire dtype is not
the one its worker declared, or whose buffers are not exactly the size that dtype makes,
then upcasts to the variable's dtype before anything is applied. Nothing received is
trusted for its dtype or its size.

Error feedback (:class:`ErrorFeedback`, the worker's side): bfloat16 keeps 8 bits of
mantissa, so a gradient component smaller than 2**-8 of another in the same rounding
would be lost step after step. The worker keeps what rounding removed (the residual, in
float32) and adds it to the next step's gradient before rounding again. The invariant, in
exact arithmetic: the sum of what was sent over k steps equals the sum of the true
gradients minus the last residual, whose size is at most half a bfloat16 ulp of the last
sum sent; nothing is lost, only delayed. A step that is dropped (a ps failed during the
push) loses its gradient as it does without the option; its residual stays. In sync mode a
worker whose update a hook vetoed pushes zeros, so it then sends only its residual.

The choice: error feedback rather than plain rounding, because plain rounding biases the
small components of Adam's input to zero; bfloat16 rather than float16, because it keeps
float32's exponent range (no scaling, no overflow to inf). The measured effect (bytes, time
per step, accuracy at equal steps) is in benchmarks/README.md.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch

from tensorfleet.errors import ConfigError, ProtocolError
from tensorfleet.wire.tensors import DTYPES, as_buffer, from_buffer

#: The wire dtypes a session may ask for: name -> (the dtype it encodes, the dtype it sends).
WIRE_DTYPES: dict[str, tuple[str, str]] = {"bf16": ("float32", "bfloat16")}


class Group(Protocol):
    """One fused buffer of a shard: its variables' dtype name and element count."""

    dtype: str
    numel: int


def check_wire_dtype(value: object) -> str | None:
    """``value`` if it names a wire dtype (or is None: the variables' own), else ConfigError."""
    if value is not None and value not in WIRE_DTYPES:
        raise ConfigError(
            f"wire_dtype must be None (gradients in their own dtype) or one of "
            f"{sorted(WIRE_DTYPES)}, got {value!r}"
        )
    return value  # type: ignore[return-value]


def travel_dtype(group_dtype: str, wire_dtype: str | None) -> str:
    """The dtype name a gradient of a ``group_dtype`` group travels as."""
    if wire_dtype is not None:
        encodes, sends = WIRE_DTYPES[wire_dtype]
        if group_dtype == encodes:
            return sends
    return group_dtype


class ErrorFeedback:
    """The worker's encoder: float32 gradients to ``wire_dtype`` with the rounding error kept
    (per shard and group) and added to the next step's gradient."""

    def __init__(self, wire_dtype: str) -> None:
        self.wire_dtype = check_wire_dtype(wire_dtype)
        if self.wire_dtype is None:
            raise ConfigError("ErrorFeedback needs a wire dtype such as 'bf16', got None")
        self._residuals: dict[Hashable, torch.Tensor] = {}
        self._encoded: dict[Hashable, torch.Tensor] = {}

    def encode(
        self,
        shard: Hashable,
        groups: Sequence[Group],
        gradients: Sequence[memoryview],
        staging: Callable[[list[int]], list[memoryview] | None] | None = None,
        slices: Sequence[tuple[int, int]] | None = None,
    ) -> list[memoryview]:
        """One shard's push: ``gradients`` (its groups' buffers in their own dtype, which
        this call may overwrite) encoded group by group. ``slices``: the elements
        ``(lo, hi)`` of each group that ``gradients`` hold (a bucket of a push made during
        the backward pass, :meth:`~tensorfleet.ps.layout.FusedLayout.part_slices`); None:
        whole groups. Each element keeps its own residual, so a step encoded bucket by bucket
        (each element once) sends exactly what the whole step encoded at once would.
        ``staging``, given the encoded sizes, may return writable buffers to encode into (a
        request's shared-memory segment); otherwise the encoder's own buffers are used."""
        spans = list(slices) if slices is not None else [(0, g.numel) for g in groups]
        sends_of = [travel_dtype(g.dtype, self.wire_dtype) for g in groups]
        sizes = [
            (hi - lo) * DTYPES[sends].itemsize
            for sends, (lo, hi) in zip(sends_of, spans, strict=True)
        ]
        targets = staging(sizes) if staging is not None else None
        out: list[memoryview] = []
        for index, (group, buffer, sends, (lo, hi)) in enumerate(
            zip(groups, gradients, sends_of, spans, strict=True)
        ):
            if sends == group.dtype:  # not encoded: as it is
                if targets is not None:
                    memoryview(targets[index]).cast("B")[:] = memoryview(buffer).cast("B")
                    out.append(targets[index])
                else:
                    out.append(buffer)
                continue
            gradient = (
                torch.frombuffer(buffer, dtype=DTYPES[group.dtype])
                if hi > lo
                else torch.empty(0, dtype=DTYPES[group.dtype])
            )
            key = (shard, index)
            encoded = (
                torch.frombuffer(targets[index], dtype=DTYPES[sends])
                if targets is not None and hi > lo
                else self._buffer(self._encoded, key, group.numel, DTYPES[sends])[lo:hi]
            )
            residual = self._buffer(self._residuals, key, group.numel, gradient.dtype, zero=True)
            self.step(gradient, encoded, residual[lo:hi])
            out.append(targets[index] if targets is not None else as_buffer(encoded))
        return out

    @staticmethod
    def step(gradient: torch.Tensor, encoded: torch.Tensor, residual: torch.Tensor) -> None:
        """``encoded`` = round(``gradient`` + ``residual``); ``residual`` becomes what the
        rounding removed. ``gradient`` is overwritten with the corrected gradient."""
        gradient.add_(residual)
        encoded.copy_(gradient)  # round to nearest even
        residual.copy_(encoded)
        torch.sub(gradient, residual, out=residual)

    def residual(self, shard: Hashable, group: int) -> torch.Tensor | None:
        """The rounding error still owed for ``shard``'s group ``group`` (None before its
        first push)."""
        return self._residuals.get((shard, group))

    @staticmethod
    def _buffer(
        pool: dict[Hashable, torch.Tensor],
        key: Hashable,
        numel: int,
        dtype: torch.dtype,
        zero: bool = False,
    ) -> torch.Tensor:
        tensor = pool.get(key)
        if tensor is None or tensor.numel() != numel or tensor.dtype != dtype:
            tensor = (torch.zeros if zero else torch.empty)(numel, dtype=dtype)
            pool[key] = tensor
        return tensor


class GradientDecoder:
    """The ps's side: each worker's wire dtype as declared in its hello, and each push's
    buffers checked against it and brought to the variables' dtypes."""

    def __init__(self) -> None:
        self._declared: dict[str, str | None] = {}

    def declare(self, task: object, wire_dtype: object) -> None:
        """Record what ``task`` said in its hello (ProtocolError for an unknown name)."""
        if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
            raise ProtocolError(
                f"{task} declares gradients on the wire as {wire_dtype!r}; this ps knows "
                f"{sorted(WIRE_DTYPES)}: run the same tensorfleet version on every task"
            )
        self._declared[str(task)] = wire_dtype  # type: ignore[assignment]

    def check_claim(self, task: object, claimed: object) -> str | None:
        """The wire dtype ``task`` declared in its hello, after checking that ``claimed`` (a
        push's) is that one (ProtocolError)."""
        declared = self._declared.get(str(task))
        if claimed != declared:
            raise ProtocolError(
                f"{task} pushed gradients as {claimed or 'their own dtype'!r} but declared "
                f"{declared or 'their own dtype'!r} in its hello: refused"
            )
        return declared

    def decode(
        self, groups: Sequence[Group], task: object, claimed: object, buffers: Sequence[Any]
    ) -> list[torch.Tensor]:
        """The push's gradients, one tensor per group in the variables' dtypes. ProtocolError
        when ``claimed`` (the push's wire dtype) is not what ``task`` declared, or a buffer's
        size is not its group's in that wire dtype."""
        declared = self.check_claim(task, claimed)
        if len(buffers) != len(groups):
            raise ProtocolError(f"gradients: {len(buffers)} buffers for {len(groups)} dtype groups")
        tensors = []
        for group, buffer in zip(groups, buffers, strict=True):
            sends = travel_dtype(group.dtype, declared)
            expected = group.numel * DTYPES[sends].itemsize
            if memoryview(buffer).nbytes != expected:
                raise ProtocolError(
                    f"gradients: the {group.dtype} buffer (sent as {sends}) has "
                    f"{memoryview(buffer).nbytes} bytes, the shard's variables need {expected}"
                )
            received = from_buffer(buffer, DTYPES[sends])
            tensors.append(received if sends == group.dtype else received.to(DTYPES[group.dtype]))
        return tensors
