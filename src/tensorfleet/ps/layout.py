"""The fused layout of one shard: its variables packed into one flat buffer per dtype.

One message per shard per step carries all of that shard's gradients (or values) as one
buffer per dtype — never one per tensor. Worker and ps derive the same layout from the same
ordered list of stored variables, so offsets never travel on the wire.

A *part* of a shard is a contiguous range ``[start, stop)`` of its variables (a bucket of a
push made during the backward pass, :mod:`tensorfleet.ps.partial_push`). Each group keeps its
members in the order of ``variables``, so a part takes one contiguous slice of each group's
buffer (:meth:`FusedLayout.part_slices`): only the range travels, never offsets.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from tensorfleet.errors import ProtocolError
from tensorfleet.wire.tensors import DTYPES, from_buffer, parse_shape

#: Dtypes a trainable variable may have (gradients need floating point).
TRAINABLE_DTYPES = ("float32", "float64", "float16", "bfloat16")
MAX_NAME_LENGTH = 512
#: The most variables one shard takes from a ``create`` (a received layout is bounded).
MAX_VARIABLES_PER_SHARD = 100_000


@dataclass(frozen=True)
class StoredVariable:
    """A variable as one shard stores it: its stored name, shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_wire(cls, data: object) -> StoredVariable:
        """Parse and validate a variable description received from a peer."""
        if not isinstance(data, dict):
            raise ProtocolError(f"a variable is a map, got {type(data).__name__}")
        name, dtype = data.get("name"), data.get("dtype")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH:
            raise ProtocolError(
                f"variable name must be a string of 1..{MAX_NAME_LENGTH} characters, got {name!r}"
            )
        if dtype not in TRAINABLE_DTYPES:
            raise ProtocolError(
                f"variable {name!r} has dtype {dtype!r}; trainable dtypes: {TRAINABLE_DTYPES}"
            )
        return cls(name, parse_shape(data.get("shape")), dtype)


@dataclass(frozen=True)
class FusedGroup:
    """One flat buffer: its dtype and, for each member variable, its (offset, numel)."""

    dtype: str
    members: tuple[tuple[StoredVariable, int], ...]
    numel: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class FusedLayout:
    """How a shard's variables are packed: one group per dtype, in order of first use."""

    variables: tuple[StoredVariable, ...]
    groups: tuple[FusedGroup, ...]

    @classmethod
    def of(cls, variables: list[StoredVariable] | tuple[StoredVariable, ...]) -> FusedLayout:
        names = Counter(v.name for v in variables)
        if len(names) != len(variables):
            # A Counter, not names.count(n) per name: that is quadratic, and a layout of the
            # 30,000 variables a header can carry took seconds of the ps's single thread.
            raise ProtocolError(
                f"duplicate variable names: {sorted(n for n, count in names.items() if count > 1)}"
            )
        order: list[str] = []
        for var in variables:
            if var.dtype not in order:
                order.append(var.dtype)
        groups = []
        for dtype in order:
            offset, members = 0, []
            for var in variables:
                if var.dtype == dtype:
                    members.append((var, offset))
                    offset += var.numel
            groups.append(FusedGroup(dtype, tuple(members), offset))
        return cls(tuple(variables), tuple(groups))

    @classmethod
    def from_wire(cls, variables: object) -> FusedLayout:
        """The layout of a received list of variables (ProtocolError if it is not one)."""
        # 0: a shard whose part of the model is only embedding-table rows holds no dense variable.
        if not isinstance(variables, list) or not 0 <= len(variables) <= MAX_VARIABLES_PER_SHARD:
            raise ProtocolError(
                f"'variables' must be a list of 0..{MAX_VARIABLES_PER_SHARD} variables"
            )
        return cls.of([StoredVariable.from_wire(v) for v in variables])

    def group_bytes(self) -> list[int]:
        return [g.numel * g.itemsize for g in self.groups]

    @cached_property
    def member_indices(self) -> tuple[tuple[int, ...], ...]:
        """For each group, the position in :attr:`variables` of each of its members
        (ascending: a group keeps the order of ``variables``)."""
        position = {var.name: index for index, var in enumerate(self.variables)}
        return tuple(tuple(position[var.name] for var, _ in g.members) for g in self.groups)

    def part_slices(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The elements ``(lo, hi)`` of each group's flat buffer that the variables
        ``[start, stop)`` take (``lo == hi`` for a group with none of them). The caller has
        checked ``0 <= start < stop <= len(variables)``."""
        slices = []
        for group, indices in zip(self.groups, self.member_indices, strict=True):
            first = bisect.bisect_left(indices, start)
            last = bisect.bisect_left(indices, stop)  # members first..last-1 are in the part
            if first == last:
                slices.append((0, 0))
                continue
            lo = group.members[first][1]
            var, offset = group.members[last - 1]
            slices.append((lo, offset + var.numel))
        return slices

    def part_bytes(self, start: int, stop: int) -> list[int]:
        """The bytes of each group's slice for the variables ``[start, stop)``."""
        return [
            (hi - lo) * g.itemsize
            for (lo, hi), g in zip(self.part_slices(start, stop), self.groups, strict=True)
        ]

    def describe_difference(self, other: FusedLayout) -> str | None:
        """None when both layouts are the same, else one sentence naming the first difference."""
        mine = {v.name: v for v in self.variables}
        theirs = {v.name: v for v in other.variables}
        for name in mine.keys() - theirs.keys():
            return f"variable {name!r} is not on this shard"
        for name in theirs.keys() - mine.keys():
            return f"this shard holds {name!r}, which the model does not have here"
        for name, var in mine.items():
            if theirs[name] != var:
                return f"variable {name!r} is {list(theirs[name].shape)} {theirs[name].dtype} on the ps, {list(var.shape)} {var.dtype} in the model"
        if self.variables != other.variables:
            return "the variables are in a different order (different placement settings?)"
        return None


def group_tensors(layout: FusedLayout, buffers: list, what: str) -> list[torch.Tensor]:
    """Received ``buffers``, one per group of ``layout``, as tensors of the groups' dtypes
    (ProtocolError naming ``what`` when their number or sizes do not fit)."""
    if len(buffers) != len(layout.groups):
        raise ProtocolError(f"{what}: {len(buffers)} buffers for {len(layout.groups)} dtype groups")
    tensors = []
    for group, buffer in zip(layout.groups, buffers, strict=True):
        if memoryview(buffer).nbytes != group.numel * group.itemsize:
            raise ProtocolError(
                f"{what}: the {group.dtype} buffer has {memoryview(buffer).nbytes} bytes, the shard's variables need {group.numel * group.itemsize}"
            )
        tensors.append(from_buffer(buffer, DTYPES[group.dtype]))
    return tensors
