"""tfl.EmbeddingTable: rows pulled per batch (unique ids, one pull per shard), gradients of
those rows only, and training that equals an nn.Embedding(sparse=True) held whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensorfleet.ps.row_initializer import RowInitializer
from tensorfleet.ps.sparse_rows import SparseGradientError
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.worker.embedding_table import EmbeddingTable, TableNotAttached
from tensorfleet.worker.local_row_source import LocalRowSource

ROWS, DIM = 500, 6
INIT = RowInitializer("normal", 0.3, seed=2)


class Recorder(LocalRowSource):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pulls: list[tuple[int, list[int]]] = []

    def pull_rows(self, table, shard, ids):
        self.pulls.append((shard, ids.tolist()))
        return super().pull_rows(table, shard, ids)


class TwoTower(nn.Module):
    """User and item embeddings (the item table used twice: positive and negative)."""

    def __init__(self, users: nn.Module, items: nn.Module) -> None:
        super().__init__()
        self.users, self.items = users, items
        self.head = nn.Linear(DIM, DIM)

    def forward(self, u, pos, neg):
        user = self.head(self.users(u))
        return (
            -(user * self.items(pos)).sum(-1).sigmoid().log().mean()
            - (-(user * self.items(neg)).sum(-1)).sigmoid().log().mean()
        )


def _batches(steps: int = 5):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        yield (
            torch.randint(0, 40, (32,), generator=g),  # few users: duplicates in each batch
            torch.randint(0, ROWS, (32,), generator=g),
            torch.randint(0, ROWS, (32,), generator=g),
        )


def _dense_reference(head_state):
    def embedding():
        weight = INIT.rows(torch.arange(ROWS), DIM, torch.float32)
        return nn.Embedding.from_pretrained(weight, freeze=False, sparse=True)

    model = TwoTower(embedding(), embedding())
    model.head.load_state_dict(head_state)
    sparse = [model.users.weight, model.items.weight]
    opts = [torch.optim.SparseAdam(sparse, lr=0.05), torch.optim.SGD(model.head.parameters(), 0.1)]
    for u, p, n in _batches():
        for opt in opts:
            opt.zero_grad()
        model(u, p, n).backward()
        for opt in opts:
            opt.step()
    return model


@pytest.mark.parametrize("shards,scheme", [(1, "mod"), (3, "mod"), (3, "range")])
def test_training_equals_dense_sparse_embedding(shards, scheme) -> None:
    torch.manual_seed(0)
    users = EmbeddingTable(ROWS, DIM, name="users", initializer=INIT, partition=scheme)
    items = EmbeddingTable(ROWS, DIM, name="items", initializer=INIT, partition=scheme)
    model = TwoTower(users, items)
    head_state = {k: v.clone() for k, v in model.head.state_dict().items()}
    source = Recorder(
        [users, items], num_shards=shards, rule=SparseRowRule("sparse_adam", {"lr": 0.05})
    )
    assert [name for name, _ in model.named_parameters()] == ["head.weight", "head.bias"]
    opt = torch.optim.SGD(model.head.parameters(), 0.1)
    for u, p, n in _batches():
        opt.zero_grad()
        model(u, p, n).backward()
        sent = items.push_gradient()
        users.push_gradient()
        opt.step()
        # One gradient for the table used twice: the union of its rows, each once.
        assert torch.equal(sent.indices, torch.unique(torch.cat([p, n])))

    reference = _dense_reference(head_state)
    for table, dense in ((users, reference.users), (items, reference.items)):
        touched = torch.cat([s.store(table.table_name).created_rows() for s in source.shards])
        touched = torch.sort(touched).values
        got = torch.cat([table(touched[k : k + 1]) for k in range(touched.numel())]).detach()
        torch.testing.assert_close(got, dense.weight.detach()[touched], rtol=0, atol=1e-6)
    torch.testing.assert_close(model.head.weight, reference.head.weight, rtol=0, atol=1e-6)


def test_forward_pulls_each_unique_row_once_per_shard() -> None:
    table = EmbeddingTable(100, 4, name="t")
    source = Recorder([table], num_shards=3)
    out = table(torch.tensor([[5, 8, 5], [11, 8, 3]]))
    assert out.shape == (2, 3, 4) and torch.equal(out[0, 0], out[0, 2])
    assert sorted(source.pulls) == [(0, [3]), (2, [5, 8, 11])]  # shard 1 has none: no request


def test_hashed_ids_strings_and_unbounded_ints() -> None:
    table = EmbeddingTable(64, 4, name="h", hash_ids=True, hash_seed=9)
    LocalRowSource([table])
    a = table(["alice", "bob", "alice"])
    assert a.shape == (3, 4) and torch.equal(a[0], a[2])
    big = table(torch.tensor([2**40, -7, 2**40]))
    assert torch.equal(big[0], big[2])
    assert table.rows_of(torch.tensor([2**40])).item() < 64
    unsigned = torch.tensor([2**63 + 5], dtype=torch.uint64)  # hashed as the same bits
    assert torch.equal(table.rows_of(unsigned), table.rows_of(unsigned.view(torch.int64)))


def test_bad_ids_and_missing_attachment_are_explained() -> None:
    table = EmbeddingTable(10, 4, name="user_emb")
    with pytest.raises(TableNotAttached, match="'user_emb' is not attached.*inside such a session"):
        table(torch.tensor([1]))
    LocalRowSource([table])
    with pytest.raises(
        SparseGradientError, match=r"'user_emb': id 12 is out of range \[0, 10\).*hash_ids=True"
    ):
        table(torch.tensor([1, 12]))
    with pytest.raises(SparseGradientError, match="int64 tensor, got list.*hash_ids=True"):
        table(["alice"])


def test_the_documented_example_runs(capsys) -> None:
    """docs/sparse.md's first example, as written (the public names and the printed line)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "sparse.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "docs/sparse.md", "exec"), {})  # noqa: S102 - our own document
    assert capsys.readouterr().out.strip() == "[10, 999999] 144 bytes"
