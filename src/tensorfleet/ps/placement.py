"""Placement: which parameter-server shard holds which variable (or which part of it).

Strategies:

* ``round_robin``: variable i goes to shard i mod n, in model order (TensorFlow's
  ``replica_device_setter`` default). Simple, but shards can end up very unequal.
* ``greedy``: largest variable first onto the shard with the fewest bytes so far
  (TensorFlow's ``GreedyLoadBalancingStrategy`` by bytes). The default.

With ``partition_threshold_bytes``, a variable larger than the threshold is first cut along
its first dimension into up to n contiguous parts (``name/part_k``), like TensorFlow's
fixed-size partitioner, so one huge embedding does not make one shard the bottleneck.

Every worker computes the same plan from the same model (the function is deterministic), and
the chief sends it to the shards; a worker whose model differs is told so by the ps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tensorfleet.errors import ConfigError

STRATEGIES = ("greedy", "round_robin")


@dataclass(frozen=True)
class VariableSpec:
    """A model variable as placement sees it: name, shape, dtype name, bytes per element."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Slice:
    """One stored piece: rows ``[row_start, row_stop)`` of ``variable`` (all rows when the
    variable is not partitioned) kept on ``shard`` under the name ``stored_name``."""

    variable: VariableSpec
    shard: int
    stored_name: str
    row_start: int
    row_stop: int

    @property
    def shape(self) -> tuple[int, ...]:
        if not self.variable.shape:
            return ()
        return (self.row_stop - self.row_start, *self.variable.shape[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.variable.itemsize

    @property
    def is_whole(self) -> bool:
        return not self.variable.shape or (
            self.row_start == 0 and self.row_stop == self.variable.shape[0]
        )


@dataclass(frozen=True)
class PlacementPlan:
    """The slices of every shard, each shard's list in model order (the fused layout)."""

    num_shards: int
    strategy: str
    shards: tuple[tuple[Slice, ...], ...]

    def shard_bytes(self) -> list[int]:
        return [sum(s.nbytes for s in shard) for shard in self.shards]

    def report(self, model: str = "") -> str:
        """A human-readable table: each stored variable, its shard and size; bytes per shard
        (headed by the model's name when it has one)."""
        of = f" of model {model!r}" if model else ""
        lines = [f"placement{of} ({self.strategy}, {self.num_shards} ps shard(s)):"]
        for shard_index, shard in enumerate(self.shards):
            for piece in shard:
                lines.append(
                    f"  ps:{shard_index}  {piece.stored_name:40s} {list(piece.shape)!s:20s} {piece.variable.dtype:9s} {piece.nbytes:>12,d} B"
                )
        for shard_index, total in enumerate(self.shard_bytes()):
            lines.append(f"  ps:{shard_index}  total {total:,d} bytes")
        return "\n".join(lines)


def plan_placement(
    variables: list[VariableSpec],
    num_shards: int,
    strategy: str = "greedy",
    partition_threshold_bytes: int | None = None,
) -> PlacementPlan:
    """Place ``variables`` (in model order) on ``num_shards`` shards."""
    if num_shards < 1:
        raise ConfigError(f"need at least one ps shard to place variables on, got {num_shards}")
    if strategy not in STRATEGIES:
        raise ConfigError(f"placement strategy must be one of {STRATEGIES}, got {strategy!r}")
    if partition_threshold_bytes is not None and partition_threshold_bytes <= 0:
        raise ConfigError(
            f"partition_threshold_bytes must be positive, got {partition_threshold_bytes}"
        )
    names = [v.name for v in variables]
    if len(set(names)) != len(names):
        raise ConfigError(f"variable names must be unique, got duplicates in {names}")

    pieces: list[tuple[VariableSpec, int, int, str]] = []  # variable, row start, row stop, name
    for var in variables:
        rows = var.shape[0] if var.shape else 1
        parts = 1
        if (
            partition_threshold_bytes is not None
            and var.shape
            and var.nbytes > partition_threshold_bytes
        ):
            parts = min(num_shards, rows)
        bounds = [rows * k // parts for k in range(parts + 1)]
        for k in range(parts):
            name = var.name if parts == 1 else f"{var.name}/part_{k}"
            stop = bounds[k + 1] if var.shape else 1
            pieces.append((var, bounds[k], stop, name))

    assignment: list[int] = [0] * len(pieces)
    if strategy == "round_robin":
        assignment = [i % num_shards for i in range(len(pieces))]
    else:
        load = [0] * num_shards
        by_size = sorted(range(len(pieces)), key=lambda i: (-_piece_bytes(pieces[i]), i))
        for i in by_size:
            shard = min(range(num_shards), key=lambda s: (load[s], s))
            assignment[i] = shard
            load[shard] += _piece_bytes(pieces[i])

    shards: list[list[Slice]] = [[] for _ in range(num_shards)]
    for (var, start, stop, name), shard in zip(pieces, assignment, strict=True):
        shards[shard].append(Slice(var, shard, name, start, stop if var.shape else 0))
    return PlacementPlan(num_shards, strategy, tuple(tuple(s) for s in shards))


def _piece_bytes(piece: tuple[VariableSpec, int, int, str]) -> int:
    var, start, stop, _ = piece
    if not var.shape:
        return var.itemsize
    return (stop - start) * math.prod(var.shape[1:]) * var.itemsize
