"""The one-process fast path of ``tfl.EmbeddingTable``: a table's own lookups and gradients
skip the scans that exist for a peer's bytes (``LocalRowSource.pull_own_rows`` and
``push_own_rows``), while ``push_rows`` still checks everything; and
``EmbeddingTable.create_all_rows()`` creates every row ahead with the very values lazy
creation gives, so training is bit for bit the same."""

from __future__ import annotations

import pytest
import torch

import tensorfleet as tfl
from tensorfleet.errors import ConfigError, UsageError
from tensorfleet.ps import row_store
from tensorfleet.ps.sparse_rows import SparseGradientError, SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.worker.embedding_table import EmbeddingTable
from tensorfleet.worker.local_row_source import LocalRowSource

pytestmark = pytest.mark.timeout(120)

ROWS, DIM = 50, 4


def _train(table: EmbeddingTable, steps: int = 12) -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, ROWS, (9,), generator=generator)
        table(ids).pow(2).sum().backward()
        table.push_gradient()


def _table_rows(source: LocalRowSource, name: str) -> dict[int, torch.Tensor]:
    out = {}
    for shard in source.shards:
        ids, values = shard.store(name).rows()
        out.update({int(i): v for i, v in zip(ids, values, strict=True)})
    return out


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("rule", ["sgd", "adagrad", "sparse_adam"])
def test_rows_created_ahead_train_bit_for_bit_as_lazy_rows(shards: int, rule: str) -> None:
    sources, tables = [], []
    for ahead in (False, True):
        table = EmbeddingTable(ROWS, DIM, name="t", initializer=tfl.RowInitializer("normal", 1.0))
        source = LocalRowSource([table], num_shards=shards, rule=SparseRowRule(rule, {"lr": 0.1}))
        if ahead:
            table.create_all_rows()
            assert sum(s.store("t").size for s in source.shards) == ROWS
        _train(table)
        sources.append(source)
        tables.append(table)
    lazy, ahead = (_table_rows(source, "t") for source in sources)
    assert len(ahead) == ROWS and set(lazy) <= set(ahead)
    for row, values in ahead.items():
        if row in lazy:  # trained (or at least looked up) by both
            assert torch.equal(values, lazy[row]), row
        else:  # never looked up: the value a first lookup would have created
            expected = tfl.RowInitializer("normal", 1.0).rows(
                torch.tensor([row]), DIM, torch.float32
            )
            assert torch.equal(values, expected[0])


def test_a_tables_own_gradient_skips_the_scans_a_peers_push_gets(monkeypatch) -> None:
    table = EmbeddingTable(ROWS, DIM, name="t")
    source = LocalRowSource([table], rule=SparseRowRule("sgd", {"lr": 0.1}))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the table's own gradient was scanned")

    monkeypatch.setattr(row_store, "check_sparse_rows", refuse)
    _train(table, steps=2)  # lookups and pushes of the table itself: no scan
    assert source.shards[0].store("t").step == 2
    monkeypatch.undo()
    # Anything else pushed through the source is checked in full, before any change.
    bad = SparseRows(torch.tensor([3, 3]), torch.ones(2, DIM))
    with pytest.raises(SparseGradientError, match="not unique"):
        source.push_rows("t", [bad])
    nan = SparseRows(torch.tensor([3]), torch.full((1, DIM), float("nan")))
    with pytest.raises(SparseGradientError, match="NaN"):
        source.push_rows("t", [nan])
    assert source.shards[0].store("t").step == 2
    # The shape and dtype are still checked on the table's own path.
    with pytest.raises(SparseGradientError, match="dim"):
        source.push_own_rows("t", [SparseRows(torch.tensor([3]), torch.ones(1, DIM + 1))])


@pytest.mark.parametrize("shards", [1, 3])
def test_rows_created_after_lookups_keep_theirs_and_train_as_lazy_rows(shards: int) -> None:
    """create_all_rows() after some steps creates only the rows not created yet: the rows
    trained so far keep their values and slots, a second call creates nothing, and the
    training that follows is bit for bit the lazy one's."""
    sources = []
    for ahead in (False, True):
        table = EmbeddingTable(ROWS, DIM, name="t", initializer=tfl.RowInitializer("normal", 1.0))
        source = LocalRowSource(
            [table], num_shards=shards, rule=SparseRowRule("adagrad", {"lr": 0.1})
        )
        _train(table, steps=3)
        if ahead:
            existing = sum(s.store("t").size for s in source.shards)
            assert 0 < existing < ROWS
            assert table.create_all_rows() == ROWS - existing
            assert table.create_all_rows() == 0
        _train(table, steps=6)
        sources.append(source)
    lazy, ahead = (_table_rows(source, "t") for source in sources)
    assert len(ahead) == ROWS
    for row, values in lazy.items():
        assert torch.equal(values, ahead[row]), row
    slots = [s.shards[0].store("t")._slots["sum"] for s in sources]
    lazy_ids, ahead_ids = (s.shards[0].store("t")._ids for s in sources)
    for k in range(sources[0].shards[0].store("t").size):  # each lazy row's slot, kept
        position = int((ahead_ids == lazy_ids[k]).nonzero()[0])
        assert torch.equal(slots[0][k], slots[1][position])


def test_create_rows_creates_a_range_and_lays_a_table_out_by_index() -> None:
    """RowStore.create_rows: only the missing rows of the range; a table created whole, in
    order, from empty, holds each row at its local index (no position lookups); refused,
    nothing changed, for a range outside the shard and a table of given rows."""
    from tensorfleet.ps.row_partition import RowPartition, TableSpec

    spec, rule = TableSpec("t", 30, DIM), SparseRowRule("sgd", {"lr": 0.1})
    store = row_store.RowStore(spec, RowPartition(30, 3), 1, rule)  # local rows 0..9: ids 1, 4, ..
    assert store.create_rows(0, 4) == 4 and store.create_rows(2, 6) == 2
    assert store.create_rows(6, 10) == 4 and store.size == 10 and store._whole
    assert store.create_rows(0, 10) == 0 and store.create_all() == 0
    assert torch.equal(store.created_rows(), torch.arange(1, 30, 3))
    out_of_order = row_store.RowStore(spec, RowPartition(30, 3), 1, rule)
    out_of_order.pull(torch.tensor([13]))  # local row 4 first
    assert out_of_order.create_all() == 9 and out_of_order.size == 10
    assert not out_of_order._whole  # positions still looked up: row 13 kept its place
    assert torch.equal(out_of_order.pull(torch.tensor([1, 13])), store.pull(torch.tensor([1, 13])))
    with pytest.raises(SparseGradientError, match=r"rows \[8, 12\) to create are outside"):
        store.create_rows(8, 12)
    given = TableSpec("g", 30, DIM, initializer=tfl.RowInitializer("given"))
    with pytest.raises(SparseGradientError, match="given rows"):
        row_store.RowStore(given, RowPartition(30, 3), 1, rule).create_rows(0, 1)


def test_create_all_rows_is_refused_where_it_cannot_hold() -> None:
    raw = EmbeddingTable(ROWS, DIM, name="raw", ids="raw")
    LocalRowSource([raw])
    with pytest.raises(ConfigError, match="ids='raw'"):
        raw.create_all_rows()

    class ShardSource:  # a row source that cannot create rows ahead
        def pull_rows(self, table: str, shard: int, ids: torch.Tensor) -> torch.Tensor:
            return torch.zeros(ids.numel(), DIM)

        def push_rows(self, table: str, parts: object) -> None:
            pass

    remote = EmbeddingTable(ROWS, DIM, name="r")
    remote.attach(ShardSource(), 1)
    with pytest.raises(UsageError, match="ShardSource.* cannot create rows ahead"):
        remote.create_all_rows()


def test_a_cpu_lookups_gradient_is_f_embeddings_bit_for_bit() -> None:
    """On the CPU a lookup gathers its rows with ``index_select`` (a cheaper backward than
    ``F.embedding``'s): the gradient of the batch's rows is still F.embedding's, bit for
    bit, with ids repeated many times."""
    table = EmbeddingTable(ROWS, DIM, name="t", initializer=tfl.RowInitializer("normal", 1.0))
    LocalRowSource([table])
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ROWS, (37, 11), generator=generator)  # about 8 uses per row
    weights = torch.randn(37, 11, DIM, generator=generator)
    (table(ids) * weights).sum().backward()
    got = table.take_gradient()
    unique, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
    rows = table(unique).detach().requires_grad_(True)  # the same rows, not updated since
    torch.nn.functional.embedding(inverse, rows).backward(weights.reshape(-1, DIM))
    assert torch.equal(got.indices, unique)
    assert torch.equal(got.values, rows.grad)
