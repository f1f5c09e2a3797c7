"""How a table row gets its first value: a pure function of (seed, row id, column).

Rows of an embedding table are created lazily, the first time a worker pulls or pushes them,
on whichever shard holds them. Their initial values must not depend on which shard that is,
on the order rows are first touched, or on the process: then a table split over three shards
holds exactly the values the same table held whole would, and a restarted ps that creates a
row again creates the same row. So the initializer is counter-based, not a stateful
generator: value ``(r, c)`` is computed from ``splitmix64`` (see
:mod:`tensorfleet.ps.id_hashing`) of ``(seed, r, c)``: of the counter ``r * 2 dim + c``
(with the seed's bits), which is one to one for row numbers. A table of raw ids
(``raw_ids=True``) keys rows by any 64-bit id, where that counter would wrap: ids that
differ only in their top bits (``x`` and ``x + 2**63``; with ``dim`` 64, any two ids equal
modulo ``2**57``, as slot-tagged feature ids are) would start from the same values. There
the counter is ``splitmix64(id)`` (a bijection on 64 bits) plus ``c`` times the golden
ratio constant, mixed twice as above: every id's values drawn independently.

Kinds (the default is ``normal`` with ``std=0.01``, a common start for recommendation
embeddings: small enough that dot products begin near zero):

* ``normal``: N(0, std^2) by Box-Muller from two 53-bit uniforms;
* ``uniform``: U(-bound, bound);
* ``zeros``;
* ``given``: no formula. The rows are sent by the chief (``fill_rows``), from the values of
  a ``sparse=True`` ``nn.Embedding`` weight the ps holds as a table of rows (see
  :mod:`tensorfleet.worker.mirrored_embeddings`); a row that has not arrived has no value,
  and asking for one is refused.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorfleet.errors import ConfigError
from tensorfleet.ps.id_hashing import splitmix64, splitmix64_
from tensorfleet.ps.sparse_rows import SparseGradientError

KINDS = ("normal", "uniform", "zeros", "given")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TWO_53 = float(1 << 53)


@dataclass(frozen=True)
class RowInitializer:
    """``kind`` (normal|uniform|zeros|given), ``scale`` (std for normal, bound for uniform),
    ``seed``."""

    kind: str = "normal"
    scale: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"row initializer kind must be one of {KINDS}, got {self.kind!r}")
        if (
            not isinstance(self.scale, (int, float))
            or not math.isfinite(self.scale)
            or (self.scale < 0)
        ):
            raise ConfigError(
                f"row initializer scale must be a finite number >= 0, got {self.scale!r}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"row initializer seed must be an int, got {self.seed!r}")

    def rows(
        self, ids: torch.Tensor, dim: int, dtype: torch.dtype, raw_ids: bool = False
    ) -> torch.Tensor:
        """The initial values of rows ``ids`` (1-D int64): ``[len(ids), dim]`` of ``dtype``;
        ``raw_ids``: the ids are a table of raw ids' keys (module docstring). A ``given``
        table has none (SparseGradientError naming the first row)."""
        if self.kind == "given" and ids.numel():
            raise SparseGradientError(
                f"row {int(ids[0])} has no value yet: its table is created from values the "
                f"chief sends (fill_rows), and they have not all arrived; the chief fills the "
                f"table when training starts, before the other workers may use it"
            )
        if self.kind == "zeros" or ids.numel() == 0:
            return torch.zeros((ids.numel(), dim), dtype=dtype)
        keys = ids.cpu().numpy().astype(np.uint64)[:, None]
        with np.errstate(over="ignore"):
            if raw_ids:  # one to one over all 64 bits, then a stride per column
                counters = splitmix64(keys) + _columns(2 * dim) * _GOLDEN
            else:
                counters = keys * np.uint64(2 * dim) + _columns(2 * dim)  # a new [n, 2 dim]
        counters ^= _seed_bits(self.seed)
        bits = splitmix64_(splitmix64_(counters))
        # 53 random bits -> a uniform in (0, 1): never 0, so log() below is finite.
        uniform = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / _TWO_53
        if self.kind == "uniform":
            values = (uniform[:, :dim] * 2.0 - 1.0) * self.scale
        else:
            radius = np.sqrt(-2.0 * np.log(uniform[:, :dim]))
            values = radius * np.cos(2.0 * math.pi * uniform[:, dim:]) * self.scale
        return torch.from_numpy(values).to(dtype)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "scale": float(self.scale), "seed": self.seed}

    @classmethod
    def from_wire(cls, data: object) -> RowInitializer:
        if not isinstance(data, dict):
            raise ConfigError(f"a row initializer is a map, got {type(data).__name__}")
        return cls(str(data.get("kind")), data.get("scale"), data.get("seed"))


@functools.lru_cache(maxsize=64)
def _seed_bits(seed: int) -> np.uint64:
    """SplitMix64 of the seed (computed once per seed: every row creation uses it)."""
    return splitmix64(np.array([seed & (2**64 - 1)], dtype=np.uint64))[0]


@functools.lru_cache(maxsize=64)
def _columns(count: int) -> np.ndarray:
    """``[1, count]`` uint64 column numbers (read only: shared between calls)."""
    columns = np.arange(count, dtype=np.uint64)[None, :]
    columns.flags.writeable = False
    return columns
