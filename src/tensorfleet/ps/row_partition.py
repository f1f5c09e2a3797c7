"""Embedding tables split by row across the ps shards: the table's description and its plan.

A :class:`TableSpec` is what every task knows of a table (name, rows, dim, dtype, how new
rows are initialized). A :class:`RowPartition` says which shard holds which row:

* ``mod`` (the default): row ``r`` lives on shard ``r mod n`` at local index ``r div n``
  (TensorFlow's ``mod`` partition strategy). Hashed or id-ordered ids spread evenly, so every
  shard sees about the same share of each batch: the pulls of a step are balanced.
* ``range``: shard ``k`` holds the contiguous rows ``[num_rows*k//n, num_rows*(k+1)//n)``
  (TensorFlow's ``div``). Useful when ids are grouped on purpose (e.g. one range per
  feature); a popular range makes one shard hot.

Every worker derives the same plan from the same spec and shard count (no randomness), the
plan is printed by ``log_placement`` (:meth:`RowPartition.report`) and written to the
checkpoint manifest (:meth:`RowPartition.to_manifest`), so a restore can check it holds the
same table cut the same way.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from tensorfleet.errors import ConfigError
from tensorfleet.ps.admission_filter import MAX_COUNT, AdmissionFilter
from tensorfleet.ps.id_hashing import hash_int_ids
from tensorfleet.ps.row_initializer import RowInitializer

SCHEMES = ("mod", "range")
#: Tables of raw ids: an id lives on shard ``splitmix64(id) mod n`` (not a user's choice).
HASH = "hash"
#: Table names: what may appear in a safetensors tensor name and a log line.
_NAME = re.compile(r"^[A-Za-z0-9_.\-/]{1,200}$")
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class TableSpec:
    """An embedding table: ``num_rows`` rows of ``dim`` values of ``dtype`` (``float32`` or
    ``float64``); rows are created on first use with ``initializer``."""

    name: str
    num_rows: int
    dim: int
    dtype: str = "float32"
    initializer: RowInitializer = RowInitializer()
    raw_ids: bool = False
    """Rows are keyed by raw int64 ids (one row per admitted id, never shared; ``num_rows``
    is then the table's capacity), not by row numbers: :mod:`tensorfleet.ps.raw_id_rows`."""
    admit_after: int = 0
    """Raw ids: how many updates must carry an id before it gets a row (0: its first lookup)."""
    expire_after_steps: int | None = None
    """Raw ids: a row (or an id's count) not looked up nor updated in this many updates of
    the table is evicted (None: never)."""
    admission_filter: AdmissionFilter | None = None
    """Raw ids, ``admit_after`` >= 1: count toward admission in a counting Bloom filter of a
    fixed size (:mod:`tensorfleet.ps.admission_filter`) instead of exactly, per id."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(
                f"table name must be 1..200 characters of letters, digits and _.-/, got "
                f"{self.name!r}"
            )
        for key in ("num_rows", "dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"table {self.name!r}: {key} must be an int >= 1, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(
                f"table {self.name!r}: dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        admit, expire = self.admit_after, self.expire_after_steps
        if not isinstance(admit, int) or isinstance(admit, bool) or admit < 0:
            raise ConfigError(
                f"table {self.name!r}: admit_after must be an int >= 0 (0: a row at the first "
                f"lookup), got {admit!r}"
            )
        if expire is not None and (
            not isinstance(expire, int) or isinstance(expire, bool) or expire < 1
        ):
            raise ConfigError(
                f"table {self.name!r}: expire_after_steps must be an int >= 1 or None (never), "
                f"got {expire!r}"
            )
        if self.admission_filter is not None:
            self._check_admission_filter()
        if not self.raw_ids and (admit != 0 or expire is not None):
            raise ConfigError(
                f"table {self.name!r}: admit_after and expire_after_steps apply to tables of "
                f"raw ids; fix: EmbeddingTable(..., ids='raw', admit_after={admit}, "
                f"expire_after_steps={expire})"
            )

    def _check_admission_filter(self) -> None:
        given, admit = self.admission_filter, self.admit_after
        if not isinstance(given, AdmissionFilter):
            raise ConfigError(
                f"table {self.name!r}: admission_filter must be a tfl.AdmissionFilter or None, "
                f"got {type(given).__name__}"
            )
        if not self.raw_ids or not 1 <= admit <= MAX_COUNT:
            raise ConfigError(
                f"table {self.name!r}: an admission filter counts raw ids toward admit_after "
                f"1..{MAX_COUNT}; got ids={'raw' if self.raw_ids else 'rows'!r}, admit_after="
                f"{admit}; fix: EmbeddingTable(..., ids='raw', admit_after=2, "
                f"admission_filter=...), or leave admission_filter out"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        return self.dim * self.torch_dtype.itemsize

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "name": self.name,
            "num_rows": self.num_rows,
            "dim": self.dim,
            "dtype": self.dtype,
            "initializer": self.initializer.to_wire(),
        }
        if self.raw_ids:  # only then: the documents of other tables are as before
            wire["raw_ids"] = {
                "admit_after": self.admit_after,
                "expire_after_steps": self.expire_after_steps,
            }
            if self.admission_filter is not None:  # only then: documents as before
                wire["raw_ids"]["admission_filter"] = self.admission_filter.to_wire()
        return wire

    @classmethod
    def from_wire(cls, data: object) -> TableSpec:
        """Parse a spec from a peer or a checkpoint (ValueError when malformed)."""
        if not isinstance(data, dict):
            raise ConfigError(f"a table spec is a map, got {type(data).__name__}")
        raw = data.get("raw_ids")
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f"a table spec's raw_ids is a map, got {type(raw).__name__}")
        try:
            return cls(
                data["name"],
                data["num_rows"],
                data["dim"],
                data["dtype"],
                RowInitializer.from_wire(data["initializer"]),
                raw_ids=raw is not None,
                admit_after=0 if raw is None else raw.get("admit_after", 0),
                expire_after_steps=None if raw is None else raw.get("expire_after_steps"),
                admission_filter=None
                if raw is None or raw.get("admission_filter") is None
                else AdmissionFilter.from_wire(raw["admission_filter"]),
            )
        except KeyError as exc:
            raise ConfigError(f"a table spec lacks {exc}") from None


@dataclass(frozen=True)
class RowPartition:
    """Which of ``num_shards`` shards holds each of ``num_rows`` rows (``scheme``: mod|range)."""

    num_rows: int
    num_shards: int
    scheme: str = "mod"

    def check_store(self, table: TableSpec, shard: int) -> None:
        """ConfigError unless a store of ``table``'s shard ``shard`` can use this partition:
        the same rows as the table, and ``shard`` one of its shards."""
        if self.num_rows != table.num_rows:
            raise ConfigError(
                f"table {table.name!r} has {table.num_rows} rows, its partition {self.num_rows}"
            )
        if not 0 <= shard < self.num_shards:
            raise ConfigError(f"shard {shard} is not one of the {self.num_shards} shards")

    def __post_init__(self) -> None:
        if self.scheme not in (*SCHEMES, HASH):
            raise ConfigError(f"row partition scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.num_shards < 1 or self.num_rows < 1:
            raise ConfigError(
                f"a row partition needs rows and shards >= 1, got {self.num_rows} rows over "
                f"{self.num_shards} shards"
            )

    def rows_on(self, shard: int) -> int:
        """How many rows shard ``shard`` holds (``hash``: at most, its share of the capacity)."""
        if self.scheme == HASH:
            return math.ceil(self.num_rows / self.num_shards)
        if self.scheme == "mod":
            return max(0, math.ceil((self.num_rows - shard) / self.num_shards))
        start, stop = self.range_of(shard)
        return stop - start

    def range_of(self, shard: int) -> tuple[int, int]:
        """``[start, stop)`` of shard ``shard`` under ``range``."""
        return (
            self.num_rows * shard // self.num_shards,
            self.num_rows * (shard + 1) // self.num_shards,
        )

    def shard_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The shard of each row id (int64, same shape)."""
        if self.num_shards == 1:  # every scheme: all on shard 0 (spares the arithmetic)
            return torch.zeros_like(ids)
        if self.scheme == HASH:
            return hash_int_ids(ids, self.num_shards)
        if self.scheme == "mod":
            return torch.remainder(ids, self.num_shards)
        starts = torch.tensor(
            [self.range_of(k)[0] for k in range(1, self.num_shards)], dtype=torch.int64
        )
        return torch.bucketize(ids, starts, right=True)

    def local_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Each row id's index among its shard's rows."""
        if self.scheme == HASH:
            raise ConfigError("a table of raw ids has no fixed local index per id")
        if self.num_shards == 1:  # mod and range: a row's index is its id (not a copy)
            return ids
        if self.scheme == "mod":
            return torch.div(ids, self.num_shards, rounding_mode="floor")
        starts = torch.tensor(
            [self.range_of(k)[0] for k in range(self.num_shards)], dtype=torch.int64
        )
        return ids - starts[self.shard_of(ids)]

    def global_of(self, shard: int, local: torch.Tensor) -> torch.Tensor:
        """The row ids of local indices ``local`` of shard ``shard``."""
        if self.scheme == "mod":
            return local * self.num_shards + shard
        return local + self.range_of(shard)[0]

    def to_manifest(self) -> dict[str, Any]:
        """The plan as a checkpoint manifest records it (each shard's rows)."""
        shards = []
        for shard in range(self.num_shards):
            entry: dict[str, Any] = {"shard": shard, "rows": self.rows_on(shard)}
            if self.scheme == HASH:
                entry["ids"] = f"splitmix64(id) mod {self.num_shards} == {shard}"
            elif self.scheme == "range":
                entry["range"] = list(self.range_of(shard))
            else:
                entry["ids"] = f"r mod {self.num_shards} == {shard}"
            shards.append(entry)
        return {
            "scheme": self.scheme,
            "num_rows": self.num_rows,
            "num_shards": self.num_shards,
            "shards": shards,
        }

    @classmethod
    def from_manifest(cls, data: object) -> RowPartition:
        if not isinstance(data, dict):
            raise ConfigError(f"a row partition is a map, got {type(data).__name__}")
        return cls(int(data["num_rows"]), int(data["num_shards"]), str(data["scheme"]))

    def report(self, table: TableSpec, slot_count: int = 0) -> str:
        """Lines for ``log_placement``: each shard's rows of ``table`` and their bytes at most
        (values plus ``slot_count`` optimizer slots per row; rows are created lazily)."""
        lines = [
            f"table {table.name!r}: {table.num_rows:,d} x {table.dim} {table.dtype}, "
            f"rows split by {self.scheme} over {self.num_shards} ps shard(s)"
        ]
        for shard in range(self.num_shards):
            rows = self.rows_on(shard)
            where = (
                f"rows [{self.range_of(shard)[0]:,d}, {self.range_of(shard)[1]:,d})"
                if self.scheme == "range"
                else f"ids hashed mod {self.num_shards} == {shard}"
                if self.scheme == HASH
                else f"rows r mod {self.num_shards} == {shard}"
            )
            full = rows * table.row_bytes * (1 + slot_count)
            lines.append(
                f"  ps:{shard}  {table.name:30s} {where:32s} {rows:>12,d} rows  <= {full:>14,d} B"
            )
        return "\n".join(lines)
