"""The memory a ps shard may use for tables (``--max-memory``), and the check that refuses a
table that would not fit.

Rows are created lazily, so a table's memory grows with the ids training touches; with
hashing every row can end up touched. The check therefore counts a table at its *full*
size on the shard: every row the partition gives it, times (values + one tensor per
optimizer slot) plus 16 bytes of bookkeeping per row (its slot index and its id), and 8 more
for a table created from given values (the version at which each row last changed, which
the workers' copies are refreshed by: :mod:`tensorfleet.ps.row_store`). A table
refused here is refused when it is created, with the numbers, instead of the ps being killed
by the kernel's OOM killer hours into training.
"""

from __future__ import annotations

import re

from tensorfleet.errors import ConfigError, TensorfleetError

#: Bookkeeping bytes per row: the local-row -> slot index and the slot -> row id (int64 each).
ROW_OVERHEAD_BYTES = 16
#: Per row of a table created from given values: the version it last changed at (int64).
ROW_VERSION_BYTES = 8
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


class TableDoesNotFit(TensorfleetError, ValueError):
    """A table's share of a ps shard exceeds that shard's memory limit."""


def parse_memory_size(text: str, flag: str = "--max-memory") -> int:
    """Bytes of ``"512MiB"``, ``"4G"`` (decimal), ``"4GiB"`` (binary), ``"1000000"``; the error
    names ``flag``."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{flag} {text!r} is not a size; write e.g. 4GiB, 512MiB, 8G or a number of "
            f"bytes (units: {', '.join(u for u in _UNITS if u)})"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def table_shard_bytes(
    rows_on_shard: int, row_bytes: int, slot_count: int, versioned: bool = False
) -> int:
    """The most bytes a shard's part of a table can take: values, slots and bookkeeping
    (``versioned``: with each row's version, for a table created from given values)."""
    overhead = ROW_OVERHEAD_BYTES + (ROW_VERSION_BYTES if versioned else 0)
    return rows_on_shard * (row_bytes * (1 + slot_count) + overhead)


def check_fits(
    *,
    table: str,
    shard: int,
    needed_bytes: int,
    used_bytes: int,
    max_bytes: int | None,
    num_shards: int,
    raw_ids: bool = False,
) -> None:
    """Refuse (TableDoesNotFit) a table part of ``needed_bytes`` on shard ``shard`` that
    already holds ``used_bytes`` of other tables, when the sum exceeds ``max_bytes``
    (``raw_ids``: a table of raw ids, whose size is its capacity, not a number of buckets)."""
    if max_bytes is None or used_bytes + needed_bytes <= max_bytes:
        return
    fewer_rows = (
        "a smaller capacity (num_rows: the most ids it holds at once; expiry and eviction "
        "keep it full of the recent ones)"
        if raw_ids
        else "fewer rows: hash ids into fewer buckets"
    )
    raise TableDoesNotFit(
        f"table {table!r} needs up to {_human(needed_bytes)} on ps:{shard} (values, optimizer "
        f"slots and 16 B per row, 24 B for a table of given rows, 40 B for a table of raw ids), which already holds {_human(used_bytes)} of other tables, "
        f"and its --max-memory is {_human(max_bytes)}; fix: run more ps tasks (now "
        f"{num_shards}), raise --max-memory, or make the table smaller ({fewer_rows}; or a "
        f"smaller dim; or an update rule with fewer slots: sgd keeps none, adagrad one, "
        f"sparse_adam two)"
    )


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit} ({nbytes:,d} B)"
    return f"{nbytes:,d} B"
