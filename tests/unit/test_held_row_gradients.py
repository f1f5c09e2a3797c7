"""Table rows held for the sync step (the mean over the contributing workers, over the union
of their rows, equal to torch's optimizer on that mean sparse gradient bit for bit) and for
the staleness gate (applied when the worker's push is released)."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.errors import ProtocolError
from tensorfleet.ps.held_row_gradients import HeldRowGradients, mean_rows
from tensorfleet.ps.row_initializer import RowInitializer
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.shard_tables import ShardTables
from tensorfleet.ps.sparse_rows import SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tests.unit.test_sparse_update_rules import RULES as SPARSE_RULES

ROWS, DIM = 30, 5
RULES = SPARSE_RULES  # (name, rule settings, the torch optimizer of the same settings)


def _tables(name: str = "sgd", hyper: dict | None = None) -> ShardTables:
    tables = ShardTables(0, 1)
    spec = TableSpec("emb", ROWS, DIM, "float32", RowInitializer("normal", 0.5, seed=3))
    tables.create(spec, RowPartition(ROWS, 1), SparseRowRule(name, hyper or {"lr": 0.3}))
    return tables


def _rows(ids: list[int], seed: int) -> SparseRows:
    values = torch.randn(len(ids), DIM, generator=torch.Generator().manual_seed(seed))
    return SparseRows(torch.tensor(ids, dtype=torch.int64), values)


def _dense(rows: SparseRows) -> torch.Tensor:
    dense = torch.zeros(ROWS, DIM)
    dense[rows.indices] = rows.values
    return dense


@pytest.mark.parametrize("name,hyper,torch_optimizer", RULES, ids=[r[0] for r in RULES])
def test_a_sync_step_applies_the_mean_over_the_union_of_rows_like_torch(
    name, hyper, torch_optimizer
) -> None:
    tables = _tables(name, hyper)
    held = HeldRowGradients(lambda: tables, sync=True, gated=False)
    param = torch.nn.Parameter(
        tables.store("emb").table.initializer.rows(torch.arange(ROWS), DIM, torch.float32)
    )
    optimizer = torch_optimizer(param)
    steps = [
        {"w0": [3, 7, 12], "w1": [7, 20], "w2": [1]},  # w2's dense push was dropped: no say
        {"w0": [], "w1": [4, 29]},
        {"w0": [5], "w1": [5]},
    ]
    for step, pushes in enumerate(steps):
        contributors = ["w0", "w1"]
        for k, (task, ids) in enumerate(pushes.items()):
            held.hold(task, "emb", _rows(ids, seed=10 * step + k), step)
        held.step_made(step, contributors)
        # torch: the dense mean (the dense sync step's arithmetic), as the coalesced sparse
        # gradient of the rows some contributor touched.
        parts = [_dense(_rows(pushes[t], seed=10 * step + k)) for k, t in enumerate(contributors)]
        mean = parts[0].clone().add_(parts[1]).div_(2)
        touched = torch.tensor(
            sorted({i for t in contributors for i in pushes[t]}), dtype=torch.int64
        )
        param.grad = torch.sparse_coo_tensor(
            touched.unsqueeze(0), mean[touched], (ROWS, DIM), check_invariants=True
        )
        optimizer.step()
    store = tables.store("emb")
    assert store.step == len(steps)
    created = store.created_rows()
    assert 1 not in created.tolist()  # only w2 touched row 1, and w2's rows were dropped
    assert torch.equal(store.pull(created), param.detach()[created])


def test_a_step_without_rows_still_counts_and_older_steps_are_dropped() -> None:
    tables = _tables()
    held = HeldRowGradients(lambda: tables, sync=True, gated=False)
    held.hold("w0", "emb", _rows([2], seed=1), 0)  # step 0 is never made (all pushes stale)
    held.step_made(1, ["w0"])
    assert tables.store("emb").step == 1 and tables.store("emb").size == 0
    assert held.held_rows == 0


def test_a_sync_push_without_its_step_is_refused() -> None:
    held = HeldRowGradients(_tables, sync=True, gated=False)
    with pytest.raises(ProtocolError, match=r"push_rows needs the integer 'step'.*got None"):
        held.hold("w0", "emb", _rows([1], seed=0), None)


def test_gated_rows_wait_for_their_workers_push() -> None:
    tables = _tables()
    held = HeldRowGradients(lambda: tables, sync=False, gated=True)
    before = tables.pull("emb", torch.tensor([1, 2]))
    held.hold("w0", "emb", _rows([1], seed=0), None)
    held.hold("w1", "emb", _rows([2], seed=1), None)
    assert torch.equal(tables.pull("emb", torch.tensor([1, 2])), before)  # held
    held.released("w1")
    after = tables.pull("emb", torch.tensor([1, 2]))
    assert torch.equal(after[0], before[0])  # w0's rows still wait
    assert torch.allclose(after[1], before[1] - 0.3 * _rows([2], seed=1).values[0], atol=1e-7)
    assert held.held_rows == 1
    held.released("w0")
    assert not torch.equal(tables.pull("emb", torch.tensor([1]))[0], before[0])
    assert tables.store("emb").step == 2 and held.held_rows == 0


def test_mean_rows_counts_contributions_without_rows_as_zero() -> None:
    mean = mean_rows([_rows([4], seed=0)], 4, DIM, torch.float32)
    assert mean.indices.tolist() == [4]
    assert torch.equal(mean.values, _rows([4], seed=0).values / 4)
    empty = mean_rows([], 2, DIM, torch.float64)
    assert empty.num_rows == 0 and empty.values.dtype == torch.float64
