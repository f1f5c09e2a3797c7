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


def test_create_all_rows_is_refused_where_it_cannot_hold() -> None:
    raw = EmbeddingTable(ROWS, DIM, name="raw", ids="raw")
    LocalRowSource([raw])
    with pytest.raises(ConfigError, match="ids='raw'"):
        raw.create_all_rows()

    table = EmbeddingTable(ROWS, DIM, name="t")
    LocalRowSource([table])
    table(torch.tensor([1, 2]))
    with pytest.raises(SparseGradientError, match="has 2 rows"):
        table.create_all_rows()  # rows exist already: too late

    class ShardSource:  # rows on ps shards: no create_all_rows
        def pull_rows(self, table: str, shard: int, ids: torch.Tensor) -> torch.Tensor:
            return torch.zeros(ids.numel(), DIM)

        def push_rows(self, table: str, parts: object) -> None:
            pass

    remote = EmbeddingTable(ROWS, DIM, name="r")
    remote.attach(ShardSource(), 1)
    with pytest.raises(UsageError, match="ps shards"):
        remote.create_all_rows()
