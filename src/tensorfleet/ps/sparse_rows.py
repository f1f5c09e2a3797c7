"""A row-sparse gradient on the wire: unique row indices plus one row of values per index.

``nn.Embedding(sparse=True)`` produces a sparse COO gradient whose indices repeat (one entry
per looked-up id). A worker coalesces it (:func:`tensorfleet.worker.sparse_gradient.
coalesce_gradient`: unique indices, duplicate rows summed, indices ascending) into
:class:`SparseRows`, which crosses the wire as two raw buffers (int64 indices, the rows) and a
small header. The bytes scale with the number of distinct rows a batch touches, never with the
table's size.

The ps checks every received :class:`SparseRows` against what it holds
(:func:`check_sparse_rows`) before touching any state: a refusal names the table, the value
seen and the fix, and leaves the shard unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tensorfleet.errors import ProtocolError, TensorfleetError
from tensorfleet.wire.tensors import DTYPES, as_buffer, dtype_name, from_buffer

#: Most rows one sparse gradient may carry (a bound on what a peer can make a ps allocate).
MAX_ROWS = 1 << 26


class SparseGradientError(TensorfleetError, ValueError):
    """A sparse gradient does not fit the table or variable it is meant for."""


@dataclass(frozen=True)
class SparseRows:
    """``indices``: int64 ``[n]``, unique; ``values``: ``[n, dim]``, row k belongs to
    ``indices[k]``. Both contiguous CPU tensors."""

    indices: torch.Tensor
    values: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.indices.numel())

    @property
    def dim(self) -> int:
        return int(self.values.shape[1]) if self.values.dim() == 2 else -1

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (both buffers; the header is a few dozen bytes more)."""
        return self.indices.numel() * 8 + self.values.numel() * self.values.element_size()

    def to_wire(self) -> tuple[dict[str, Any], list[memoryview]]:
        """The header (msgpack-able) and the two buffers, without copies."""
        header = {"rows": self.num_rows, "dim": self.dim, "dtype": dtype_name(self.values.dtype)}
        return header, [as_buffer(self.indices), as_buffer(self.values)]

    @classmethod
    def from_wire(cls, header: object, buffers: list[Any]) -> SparseRows:
        """Parse what a peer sent (ProtocolError for anything malformed). The tensors are
        views of the received bytes: copy them before keeping them."""
        if not isinstance(header, dict) or len(buffers) != 2:
            raise ProtocolError(
                f"a sparse gradient is a header map and 2 buffers, got {type(header).__name__} "
                f"and {len(buffers)} buffer(s)"
            )
        rows, dim, dtype = header.get("rows"), header.get("dim"), header.get("dtype")
        for key, value in (("rows", rows), ("dim", dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ProtocolError(f"sparse gradient {key} must be an int >= 0, got {value!r}")
        if rows > MAX_ROWS:
            raise ProtocolError(f"sparse gradient has {rows} rows; at most {MAX_ROWS} per push")
        if dtype not in DTYPES or not DTYPES[dtype].is_floating_point:
            raise ProtocolError(f"sparse gradient dtype {dtype!r} is not a floating-point dtype")
        indices = from_buffer(buffers[0], torch.int64, (rows,))
        values = from_buffer(buffers[1], DTYPES[dtype], (rows, dim))
        return cls(indices, values)


def check_sparse_rows(
    table: str,
    rows: SparseRows,
    *,
    num_rows: int,
    dim: int,
    dtype: torch.dtype,
    held_dense: bool = False,
    raw_ids: bool = False,
) -> None:
    """Refuse (SparseGradientError) a sparse gradient that does not fit table ``table`` of
    ``num_rows`` x ``dim`` ``dtype``; ``held_dense``: the ps holds it as a dense variable;
    ``raw_ids``: the indices are raw int64 ids (any value), not rows in ``[0, num_rows)``."""
    if held_dense:
        raise SparseGradientError(
            f"a sparse gradient was pushed for {table!r}, which the ps holds as a dense "
            f"variable (its update rule reads every element); fix: build the same model on "
            f"every worker (the ps holds an nn.Embedding(sparse=True) weight as rows, and the "
            f"chief's model has this one dense), make it an EmbeddingTable, or give the "
            f"parameter dense gradients (nn.Embedding(sparse=False))"
        )
    check_row_shapes(table, rows, dim, dtype)
    if rows.num_rows == 0:
        return
    low, high = (int(bound) for bound in torch.aminmax(rows.indices))
    if not raw_ids and (low < 0 or high >= num_rows):
        bad = rows.indices[(rows.indices < 0) | (rows.indices >= num_rows)]
        raise SparseGradientError(
            f"table {table!r}: row id {int(bad[0])} is out of range [0, {num_rows}) "
            f"({bad.numel()} of {rows.num_rows} ids are); fix: hash unbounded ids into the "
            f"table (hash_ids=True) or make num_rows larger"
        )
    if not strictly_ascending(rows.indices) and torch.unique(rows.indices).numel() != rows.num_rows:
        raise SparseGradientError(
            f"table {table!r}: the {rows.num_rows} row indices are not unique; fix: coalesce "
            f"the gradient on the worker (tensorfleet.worker.sparse_gradient.coalesce_gradient)"
        )
    if not bool(torch.isfinite(rows.values).all()):
        raise SparseGradientError(
            f"table {table!r}: the sparse gradient holds NaN or infinite values; fix: find the "
            f"source of the non-finite loss (tfl.NanGuard stops or skips such steps)"
        )


def check_row_shapes(table: str, rows: SparseRows, dim: int, dtype: torch.dtype) -> None:
    """Refuse (SparseGradientError) rows that are not int64 ids ``[n]`` and values ``[n,
    dim]`` of ``dtype``: the checks of :func:`check_sparse_rows` that read no element (all
    a gradient made in this process by the table itself gets)."""
    if rows.values.dim() != 2 or rows.indices.dim() != 1:
        raise SparseGradientError(
            f"table {table!r}: a sparse gradient is indices [n] and rows [n, dim], got indices "
            f"{list(rows.indices.shape)} and rows {list(rows.values.shape)}"
        )
    if rows.values.shape[0] != rows.indices.shape[0]:
        raise SparseGradientError(
            f"table {table!r}: {rows.indices.shape[0]} indices but {rows.values.shape[0]} rows"
        )
    if rows.dim != dim:
        raise SparseGradientError(
            f"table {table!r} has rows of dim {dim}, the gradient's rows have dim {rows.dim}; "
            f"fix: build the model's table with dim={dim} (the ps holds it so)"
        )
    if rows.values.dtype != dtype:
        raise SparseGradientError(
            f"table {table!r} is {dtype}, the gradient rows are {rows.values.dtype}; fix: keep "
            f"the model's table in {dtype} (or cast the gradient before pushing)"
        )
    if rows.indices.dtype != torch.int64:
        raise SparseGradientError(
            f"table {table!r}: row indices must be int64, got {rows.indices.dtype}"
        )


def strictly_ascending(indices: torch.Tensor) -> bool:
    """Whether ``indices`` strictly ascend (so they are unique): one comparison of
    neighbours, where a sort would cost more; coalesced gradients always ascend."""
    return bool((indices[1:] > indices[:-1]).all())
