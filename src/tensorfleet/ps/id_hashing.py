"""Stable hashing of unbounded ids (int64 or strings) into a table's fixed number of rows.

User ids, item ids or URLs come from a space far larger than any table, and new ones keep
arriving. An :class:`~tensorfleet.worker.embedding_table.EmbeddingTable` built with
``hash_ids=True`` maps each id to ``hash(id) mod num_rows`` (distinct ids may share a row: the
usual hashing trick; more rows, fewer collisions). The hash must give the same row on every
worker, in every process and in every later run that restores a checkpoint, so it is never
Python's ``hash()`` (salted per process for strings). The functions, precisely:

* int ids: ``splitmix64(id XOR seed_mix)`` where ``id`` is read as an unsigned 64-bit number,
  ``seed_mix = splitmix64(seed)``, and ``splitmix64`` is the finalizer of Steele, Lea & Flood's
  SplitMix64 (``z += 0x9E3779B97F4A7C15; z = (z ^ z>>30) * 0xBF58476D1CE4E5B9;
  z = (z ^ z>>27) * 0x94D049BB133111EB; z ^ z>>31``, all modulo 2**64);
* strings: BLAKE2b of the UTF-8 bytes with an 8-byte digest, keyed with the seed's 8
  little-endian bytes, read as a little-endian unsigned 64-bit number (bytes: the same,
  without the encoding).

The row is that 64-bit value modulo ``num_rows``. Vectorized over numpy's ``uint64`` (whose
arithmetic wraps modulo 2**64 by definition), about 30 ns per id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from tensorfleet.errors import ConfigError, ConfigTypeError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's output function applied elementwise to ``uint64`` values."""
    z = values.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def splitmix64_(values: np.ndarray) -> np.ndarray:
    """:func:`splitmix64` in place, on a writable ``uint64`` array (fewer temporaries: the
    row initializer mixes every new row's values through it twice); returns ``values``."""
    with np.errstate(over="ignore"):
        values += _GOLDEN
        values ^= values >> np.uint64(30)
        values *= _MIX1
        values ^= values >> np.uint64(27)
        values *= _MIX2
        values ^= values >> np.uint64(31)
    return values


def _seed_mix(seed: int) -> np.uint64:
    return splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]


def hash_int_ids(ids: torch.Tensor, num_rows: int, seed: int = 0) -> torch.Tensor:
    """Rows in ``[0, num_rows)`` of int64 ``ids`` (any shape; the result has the same shape;
    uint64 ids hash as the int64 of the same bits: the hash reads them unsigned anyway)."""
    if ids.dtype == torch.uint64:
        ids = ids.view(torch.int64)
    if ids.dtype not in (torch.int64, torch.int32):
        raise ConfigTypeError(f"ids to hash must be int64, uint64 or int32, got {ids.dtype}")
    _check_rows(num_rows)
    raw = ids.detach().to(torch.int64).cpu().numpy().view(np.uint64)
    hashed = splitmix64(raw ^ _seed_mix(seed)) % np.uint64(num_rows)
    return torch.from_numpy(hashed.astype(np.int64)).view(ids.shape)


def hash_string_ids(ids: Sequence[str | bytes], num_rows: int, seed: int = 0) -> torch.Tensor:
    """Rows in ``[0, num_rows)`` of string (or bytes) ``ids``, as a 1-D int64 tensor."""
    _check_rows(num_rows)
    key = (seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    out = np.empty(len(ids), dtype=np.uint64)
    for k, item in enumerate(ids):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        digest = hashlib.blake2b(data, digest_size=8, key=key).digest()
        out[k] = int.from_bytes(digest, "little")
    return torch.from_numpy((out % np.uint64(num_rows)).astype(np.int64))


def _check_rows(num_rows: int) -> None:
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < 1:
        raise ConfigError(f"num_rows to hash into must be a positive int, got {num_rows!r}")
