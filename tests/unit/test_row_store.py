"""Embedding tables on the ps: row partition plans, stable id hashing, the counter-based row
initializer, a shard's lazily created row store with its checkpoint document, and the
memory limit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tensorfleet.errors import CheckpointError
from tensorfleet.ps.id_hashing import hash_int_ids, hash_string_ids
from tensorfleet.ps.memory_budget import TableDoesNotFit, parse_memory_size, table_shard_bytes
from tensorfleet.ps.row_initializer import RowInitializer
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.row_store import RowStore
from tensorfleet.ps.shard_tables import ShardTables, UnknownTable
from tensorfleet.ps.sparse_rows import SparseGradientError, SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule


@pytest.mark.parametrize("scheme", ["mod", "range"])
@pytest.mark.parametrize("num_rows,shards", [(10, 3), (7, 7), (5, 1), (1000003, 4)])
def test_partition_covers_every_row_once(scheme, num_rows, shards) -> None:
    plan = RowPartition(num_rows, shards, scheme)
    ids = torch.arange(num_rows) if num_rows < 1000 else torch.randint(0, num_rows, (5000,))
    shard, local = plan.shard_of(ids), plan.local_of(ids)
    assert sum(plan.rows_on(k) for k in range(shards)) == num_rows
    for k in range(shards):
        mine = shard == k
        assert bool((local[mine] < plan.rows_on(k)).all()) and bool((local[mine] >= 0).all())
        assert torch.equal(plan.global_of(k, local[mine]), ids[mine])
    if num_rows < 1000:
        pairs = set(zip(shard.tolist(), local.tolist(), strict=True))
        assert len(pairs) == num_rows


def test_partition_report_and_manifest() -> None:
    table = TableSpec("user_emb", 10, 4)
    mod = RowPartition(10, 3, "mod")
    assert [s["rows"] for s in mod.to_manifest()["shards"]] == [4, 3, 3]
    assert RowPartition.from_manifest(json.loads(json.dumps(mod.to_manifest()))) == mod
    report = RowPartition(10, 3, "range").report(table, slot_count=2)
    assert "ps:2" in report and "rows [6, 10)" in report and f"{4 * 16 * 3:,d} B" in report


def test_int_hash_is_stable_known_and_spread() -> None:
    ids = torch.tensor([0, 1, 2, -1, 2**62])
    rows = hash_int_ids(ids, 1 << 20)
    # Known values: the function is documented, other implementations must agree.
    assert rows.tolist() == hash_int_ids(ids.clone(), 1 << 20).tolist()
    assert rows.tolist() == [int(x) % (1 << 20) for x in _splitmix_reference(ids.tolist())]
    assert hash_int_ids(ids, 1 << 20, seed=1).tolist() != rows.tolist()
    many = hash_int_ids(torch.arange(100_000), 100)
    counts = torch.bincount(many, minlength=100)
    assert int(counts.min()) > 800 and int(counts.max()) < 1200  # about 1000 each


def _splitmix_reference(values: list[int], seed: int = 0) -> list[int]:
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    return [mix((v & mask) ^ mix(seed)) for v in values]


def test_string_hash_does_not_depend_on_the_process() -> None:
    here = hash_string_ids(["alice", "bob", b"\x00raw", "ünï"], 1000, seed=3).tolist()
    code = (
        "from tensorfleet.ps.id_hashing import hash_string_ids;"
        "print(hash_string_ids(['alice', 'bob', b'\\x00raw', 'ünï'], 1000, seed=3).tolist())"
    )
    for salt in ("1", "2"):  # Python's own str hash() differs between these two
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PYTHONHASHSEED": salt, "PATH": ""},
            check=True,
        )
        assert json.loads(out.stdout) == here, out.stderr


def test_initializer_is_a_function_of_the_row_only() -> None:
    init = RowInitializer("normal", 0.5, seed=11)
    ids = torch.tensor([4, 9, 1, 7])
    rows = init.rows(ids, 6, torch.float32)
    assert torch.equal(init.rows(ids[[2, 0]], 6, torch.float32), rows[[2, 0]])
    big = init.rows(torch.arange(20000), 8, torch.float64)
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 0.5) < 0.01
    uniform = RowInitializer("uniform", 0.1).rows(torch.arange(5000), 4, torch.float32)
    assert float(uniform.abs().max()) <= 0.1 and float(uniform.std()) > 0.05
    assert not RowInitializer("zeros").rows(ids, 3, torch.float32).any()
    assert not torch.equal(RowInitializer(seed=12).rows(ids, 6, torch.float32), rows)
    with pytest.raises(ValueError, match="kind"):
        RowInitializer("xavier")


def _store(shard: int = 1, shards: int = 3, rule: str = "adagrad") -> RowStore:
    table = TableSpec("item_emb", 20, 4, initializer=RowInitializer("normal", 1.0, seed=5))
    return RowStore(table, RowPartition(20, shards, "mod"), shard, SparseRowRule(rule, {"lr": 0.1}))


def test_store_creates_rows_lazily_and_grows() -> None:
    store = _store()
    assert store.size == 0
    rows = store.pull(torch.tensor([7, 1, 7]))
    assert store.size == 2 and torch.equal(rows[0], rows[2])
    assert torch.equal(
        rows, store.table.initializer.rows(torch.tensor([7, 1, 7]), 4, torch.float32)
    )
    store.apply(SparseRows(torch.tensor([4, 1]), torch.ones(2, 4)))
    assert store.created_rows().tolist() == [1, 4, 7] and store.step == 1
    assert not torch.equal(store.pull(torch.tensor([1])), rows[1:2])


def test_store_refuses_bad_ids_and_loses_nothing() -> None:
    store = _store()
    store.apply(SparseRows(torch.tensor([1]), torch.ones(1, 4)))
    before = store.encode()
    for call, words in [
        (lambda: store.pull(torch.tensor([2])), "row 2 belongs to shard 2, not to this shard 1"),
        (lambda: store.pull(torch.tensor([25])), "row id 25 is out of range .0, 20.; fix: hash"),
        (lambda: store.pull(torch.tensor([1.0])), "1-D int64"),
        (
            lambda: store.apply(SparseRows(torch.tensor([1, 3]), torch.ones(2, 4))),
            "row 3 belongs to shard 0",
        ),
        (lambda: store.apply(SparseRows(torch.tensor([4]), torch.ones(1, 5))), "dim 4"),
    ]:
        with pytest.raises(SparseGradientError, match=words):
            call()
    assert store.encode() == before


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "sparse_adam"])
def test_store_checkpoint_round_trip(rule) -> None:
    store = _store(rule=rule)
    for step in range(3):
        ids = torch.tensor([1, 4, 13][: step + 1])
        store.apply(SparseRows(ids, torch.full((ids.numel(), 4), float(step + 1))))
    copy = RowStore.decode(store.encode(), expect=store.table)
    assert copy.step == 3 and torch.equal(copy.created_rows(), store.created_rows())
    # The same next update gives the same bits: values and slots came back exactly.
    for s in (store, copy):
        s.apply(SparseRows(torch.tensor([4, 16]), torch.full((2, 4), 0.5)))
    ids = torch.tensor([1, 4, 13, 16])
    assert torch.equal(copy.pull(ids), store.pull(ids))


def test_store_checkpoint_refuses_a_document_that_does_not_fit() -> None:
    store = _store()
    store.pull(torch.tensor([1]))
    other = TableSpec("item_emb", 20, 8)
    with pytest.raises(CheckpointError, match="the model has"):
        RowStore.decode(store.encode(), expect=other)
    with pytest.raises(CheckpointError, match="cannot be read"):
        RowStore.decode(b"\x10\x00\x00\x00\x00\x00\x00\x00{}              ")
    from safetensors.torch import save

    doc = store.encode()
    length = int.from_bytes(doc[:8], "little")
    meta = json.loads(doc[8 : 8 + length])["__metadata__"]
    forged = save(
        {"ids": torch.tensor([2]), "values": torch.zeros(1, 4), "slot/sum": torch.zeros(1, 4)},
        meta,
    )
    with pytest.raises(CheckpointError, match="rows of another shard"):
        RowStore.decode(forged)


def test_memory_limit_refuses_a_table_that_does_not_fit() -> None:
    assert parse_memory_size("4GiB") == 4 << 30 and parse_memory_size("1.5G") == 1_500_000_000
    assert parse_memory_size("123") == 123
    with pytest.raises(ValueError, match="not a size"):
        parse_memory_size("lots")
    table = TableSpec("big", 20_000_000, 64)
    partition = RowPartition(table.num_rows, 2)
    rule = SparseRowRule("sparse_adam")
    need = table_shard_bytes(10_000_000, 256, 2)
    assert need == 10_000_000 * (256 * 3 + 16)
    tables = ShardTables(0, 2, max_memory=parse_memory_size("4GiB"))
    with pytest.raises(TableDoesNotFit) as info:
        tables.create(table, partition, rule)
    message = str(info.value)
    assert "'big'" in message and "7.30 GiB" in message and "4.00 GiB" in message
    assert "run more ps tasks (now 2)" in message and len(tables) == 0
    # The fix the message names works: sgd keeps no slots, 10M x (256 + 16) B fits in 4 GiB.
    assert tables.create(table, partition, SparseRowRule("sgd")) is True


def test_shard_tables_create_pull_apply_save_restore() -> None:
    tables = ShardTables(0, 2, max_memory=parse_memory_size("1MiB"))
    table = TableSpec("user_emb", 1000, 8)
    partition, rule = RowPartition(1000, 2), SparseRowRule("sgd", {"lr": 1.0})
    assert tables.create(table, partition, rule) is True
    assert tables.create(table, partition, rule) is False  # idempotent: every worker may ask
    with pytest.raises(ValueError, match="exists on ps:0"):
        tables.create(TableSpec("user_emb", 1000, 16), partition, rule)
    with pytest.raises(TableDoesNotFit, match="'second'.*already holds"):
        tables.create(TableSpec("second", 60000, 8), RowPartition(60000, 2), rule)
    tables.apply("user_emb", SparseRows(torch.tensor([0, 6]), torch.ones(2, 8)))
    saved = tables.save()
    tables.apply("user_emb", SparseRows(torch.tensor([6]), torch.ones(1, 8)))
    tables.restore(saved)
    after = tables.pull("user_emb", torch.tensor([6]))
    assert torch.equal(after, table.initializer.rows(torch.tensor([6]), 8, torch.float32) - 1)
    with pytest.raises(UnknownTable, match="holds no table 'nope'.*user_emb"):
        tables.pull("nope", torch.tensor([0]))


def test_a_raw_id_table_over_the_limit_is_told_to_hold_fewer_ids_not_to_hash_them() -> None:
    """A table of raw ids cannot be hashed into fewer buckets (hash_ids is refused there):
    its fix is a smaller capacity."""
    table = TableSpec("users", 2_000_000, 64, raw_ids=True, admit_after=2)
    tables = ShardTables(0, 2, max_memory=parse_memory_size("64MiB"))
    with pytest.raises(TableDoesNotFit) as info:
        tables.create(table, RowPartition(table.num_rows, 2), SparseRowRule("adagrad"))
    message = str(info.value)
    assert "a smaller capacity (num_rows" in message and "hash ids" not in message
