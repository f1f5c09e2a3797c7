"""The worker's encoding of a sparse gradient: coalesced into unique row indices and rows.

``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` give their weight a sparse
COO gradient with one entry per looked-up id, duplicates included. Before it goes on the
wire the worker coalesces it with torch's own ``coalesce`` (indices ascending, duplicate
rows summed), so the ps receives each touched row once and applies its row-sparse rule
exactly as ``torch.optim`` would to the same coalesced gradient. A gradient that is sparse in
more than the first dimension is first turned into whole rows (zeros filled in).
"""

from __future__ import annotations

import torch

from tensorfleet.ps.sparse_rows import SparseGradientError, SparseRows


def coalesce_gradient(name: str, grad: torch.Tensor) -> SparseRows:
    """The unique rows of sparse COO gradient ``grad`` of parameter ``name`` (a 2-D weight)."""
    if not grad.is_sparse:
        raise SparseGradientError(
            f"parameter {name!r}: expected a sparse COO gradient, got a {grad.layout} one"
        )
    if grad.dim() != 2:
        raise SparseGradientError(
            f"parameter {name!r}: row-sparse gradients are for 2-D weights [rows, dim]; its "
            f"gradient is {list(grad.shape)}"
        )
    coalesced = grad.detach().coalesce()
    indices, values = coalesced.indices(), coalesced.values()
    if coalesced.sparse_dim() == 1:
        return SparseRows(indices[0].contiguous(), values.contiguous())
    # Fully sparse [rows, dim] (sparse_dim 2): gather each touched row, zeros elsewhere.
    rows, position = torch.unique(indices[0], sorted=True, return_inverse=True)
    dense_rows = values.new_zeros((rows.numel(), grad.shape[1]))
    dense_rows.index_put_((position, indices[1]), values, accumulate=True)
    return SparseRows(rows.contiguous(), dense_rows)


def split_rows(rows: SparseRows, shard_of_row: torch.Tensor, num_shards: int) -> list[SparseRows]:
    """``rows`` cut by shard: ``shard_of_row[k]`` is the shard of ``rows.indices[k]``. Every
    shard gets an entry, empty when none of its rows was touched (a shard counts every step
    of the table: see :mod:`tensorfleet.ps.sparse_update_rules`)."""
    parts = []
    for shard in range(num_shards):
        where = torch.nonzero(shard_of_row == shard).flatten()
        parts.append(SparseRows(rows.indices[where], rows.values.index_select(0, where)))
    return parts


def densify_sparse_gradients(named_params: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Turn every sparse COO gradient of ``named_params`` into the dense gradient of its
    variable, in place (through :func:`coalesce_gradient`: duplicate ids summed once, rows
    added into zeros), and return the names of the variables that had one.

    What the parameter-server modes do today with the sparse gradient of a variable the ps
    holds dense (``nn.Embedding(..., sparse=True)`` in a model): the shard's fused gradient
    buffer is dense, so the gradient is pushed dense and the shard's rule applies to it. With
    ``SGD`` (no momentum, no weight decay) that is exactly the row-sparse update, since the
    rows not touched get a zero gradient; with ``Adagrad`` the values of the untouched rows
    are unchanged too but the touched rows' arithmetic is torch's dense kernel, not its sparse
    one. Pushing only the touched rows is what :class:`tensorfleet.EmbeddingTable` does."""
    densified = []
    for name, param in named_params:
        grad = param.grad
        if grad is None or not grad.is_sparse:
            continue
        if grad.dim() != 2:  # not rows of a weight: coalesce sums duplicates, zeros filled in
            param.grad = grad.coalesce().to_dense()
        else:
            rows = coalesce_gradient(name, grad)
            dense = torch.zeros(grad.shape, dtype=rows.values.dtype, device=grad.device)
            dense.index_copy_(0, rows.indices.to(grad.device), rows.values.to(grad.device))
            param.grad = dense
        densified.append(name)
    return densified
