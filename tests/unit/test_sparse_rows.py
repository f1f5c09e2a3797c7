"""The worker's coalesced encoding of a sparse gradient, its wire form, and the ps's checks."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.errors import ProtocolError, TensorfleetError
from tensorfleet.ps.sparse_rows import SparseGradientError, SparseRows, check_sparse_rows
from tensorfleet.worker.sparse_gradient import coalesce_gradient, split_rows


def _grad(ids: list[int], dim: int = 4, num_rows: int = 10) -> torch.Tensor:
    emb = torch.nn.Embedding(num_rows, dim, sparse=True)
    emb(torch.tensor(ids)).sum(0).mul(torch.arange(dim) + 1.0).sum().backward()
    return emb.weight.grad


def test_coalesce_sums_duplicates_and_sorts() -> None:
    rows = coalesce_gradient("emb.weight", _grad([7, 2, 7, 7, 0]))
    assert rows.indices.tolist() == [0, 2, 7]
    assert rows.values.tolist() == [[1, 2, 3, 4], [1, 2, 3, 4], [3, 6, 9, 12]]
    assert rows.nbytes == 3 * 8 + 3 * 4 * 4


def test_coalesce_embedding_bag_and_fully_sparse_gradients() -> None:
    bag = torch.nn.EmbeddingBag(10, 3, mode="sum", sparse=True)
    bag(torch.tensor([1, 4, 1, 9]), torch.tensor([0, 2])).sum().backward()
    rows = coalesce_gradient("bag.weight", bag.weight.grad)
    assert rows.indices.tolist() == [1, 4, 9]
    assert torch.equal(rows.values, torch.tensor([[2.0] * 3, [1.0] * 3, [1.0] * 3]))

    fully = torch.sparse_coo_tensor([[3, 3, 1], [0, 2, 2]], [1.0, 2.0, 5.0], (6, 3))
    rows = coalesce_gradient("w", fully)
    assert rows.indices.tolist() == [1, 3]
    assert rows.values.tolist() == [[0, 0, 5], [1, 0, 2]]


def test_coalesce_refuses_dense_and_non_matrix_gradients() -> None:
    with pytest.raises(SparseGradientError, match="'w': expected a sparse COO gradient"):
        coalesce_gradient("w", torch.zeros(3, 2))
    with pytest.raises(SparseGradientError, match="2-D weights"):
        coalesce_gradient("w", torch.zeros(3).to_sparse())


def test_wire_round_trip_and_malformed_input() -> None:
    rows = coalesce_gradient("w", _grad([3, 1, 3]))
    header, buffers = rows.to_wire()
    back = SparseRows.from_wire(header, [bytes(b) for b in buffers])
    assert torch.equal(back.indices, rows.indices) and torch.equal(back.values, rows.values)
    for bad_header, bad_buffers, words in [
        ({**header, "rows": 3}, buffers, "bytes hold"),
        ({**header, "dtype": "int64"}, buffers, "floating-point"),
        ({**header, "rows": -1}, buffers, "int >= 0"),
        ({**header, "rows": True}, buffers, "int >= 0"),
        (header, buffers[:1], "2 buffers"),
        ([1], buffers, "header map"),
    ]:
        with pytest.raises(ProtocolError, match=words):
            SparseRows.from_wire(bad_header, [bytes(b) for b in bad_buffers])


def _check(rows: SparseRows, **kw) -> None:
    args = {"num_rows": 10, "dim": 4, "dtype": torch.float32, **kw}
    check_sparse_rows("user_emb", rows, **args)


def test_ps_checks_name_the_table_the_value_and_the_fix() -> None:
    good = SparseRows(torch.tensor([1, 9]), torch.ones(2, 4))
    _check(good)
    cases = [
        (
            SparseRows(torch.tensor([1, 12]), torch.ones(2, 4)),
            {},
            "row id 12 is out of range .0, 10.*hash_ids=True",
        ),
        (SparseRows(torch.tensor([-1]), torch.ones(1, 4)), {}, "row id -1 is out of range"),
        (good, {"dim": 8}, "dim 8, the gradient's rows have dim 4; fix: build"),
        (good, {"dtype": torch.float64}, "is torch.float64, the gradient rows are torch.float32"),
        (good, {"held_dense": True}, "holds as a dense variable.*EmbeddingTable"),
        (SparseRows(torch.tensor([2, 2]), torch.ones(2, 4)), {}, "not unique; fix: coalesce"),
        (SparseRows(torch.tensor([2]), torch.ones(2, 4)), {}, "1 indices but 2 rows"),
        (SparseRows(torch.tensor([2]), torch.tensor([[float("nan")] * 4])), {}, "NaN"),
    ]
    for rows, kw, words in cases:
        with pytest.raises(SparseGradientError, match=words) as info:
            _check(rows, **kw)
        assert "'user_emb'" in str(info.value)
        assert isinstance(info.value, TensorfleetError) and isinstance(info.value, ValueError)
    _check(SparseRows(torch.empty(0, dtype=torch.int64), torch.empty(0, 4)))


def test_split_rows_gives_every_shard_an_entry() -> None:
    rows = SparseRows(torch.tensor([0, 3, 4, 6]), torch.arange(8.0).view(4, 2))
    parts = split_rows(rows, rows.indices % 3, 3)
    assert [p.indices.tolist() for p in parts] == [[0, 3, 6], [4], []]
    assert parts[1].values.tolist() == [[4.0, 5.0]] and parts[2].values.shape == (0, 2)
