"""The rows of a ``sparse=True`` embedding weight on the ps: a table created from given values
(sent by the chief in chunks under the message limits), whose rows remember the version at
which they last changed, so that a worker's pull takes only the rows changed since the version
it saw (every row after the shard's incarnation changed); and the refusals, each naming the
parameter or table, the value and the fix, with the shard left up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.errors import ConfigError, ConfigTypeError, RemoteError
from tensorfleet.ps.memory_budget import table_shard_bytes
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.row_initializer import RowInitializer
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.row_store import RowStore
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.sparse_rows import SparseGradientError, SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule, SparseRuleError
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.wire.message import Limits
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.worker.mirrored_embeddings import MirroredEmbeddings, mirror_weight
from tensorfleet.worker.ps_updater import PsUpdater
from tensorfleet.worker.timeouts import ClientTimeouts

from .service_harness import RunningService, serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(60)
SECRET = b"mirrored-rows-unit-test-secret-000000000"
TIMEOUTS = ClientTimeouts(connect_s=10.0, initialize_s=10.0, step_s=10.0)
SGD = SparseRowRule("sgd", {"lr": 0.5})


def _given_store(rows: int = 10, dim: int = 3, shard: int = 0, shards: int = 1) -> RowStore:
    spec = TableSpec("emb.weight", rows, dim, "float32", RowInitializer("given"))
    return RowStore(spec, RowPartition(rows, shards), shard, SGD)


def _filled(store: RowStore) -> torch.Tensor:
    ids = store.partition.global_of(store.shard, torch.arange(store.local_rows))
    values = torch.arange(ids.numel() * store.table.dim, dtype=torch.float32).view(ids.numel(), -1)
    store.fill(ids[:4], values[:4])
    store.fill(ids[4:], values[4:])
    return values


def test_a_given_table_has_no_row_until_the_chief_sends_it():
    store = _given_store()
    with pytest.raises(SparseGradientError, match="has 0 of its 10 rows.*fill_rows"):
        store.pull(torch.tensor([3]))
    store.fill(torch.tensor([0, 1]), torch.ones(2, 3))
    assert not store.complete
    with pytest.raises(SparseGradientError, match="has 2 of its 10 rows"):
        store.check(SparseRows(torch.tensor([1]), torch.ones(1, 3)))  # refused when held
    with pytest.raises(SparseGradientError, match="has 2 of its 10 rows"):
        store.changed_since(None)
    store.fill(torch.arange(2, 10), torch.zeros(8, 3))
    assert store.complete and torch.equal(store.pull(torch.tensor([1])), torch.ones(1, 3))


def test_changed_since_gives_exactly_the_rows_an_update_touched():
    store = _given_store()
    values = _filled(store)
    ids, rows, following = store.changed_since(None)
    assert sorted(ids.tolist()) == list(range(10)) and following is None
    assert torch.equal(rows[torch.argsort(ids)], values)
    seen = store.version
    store.apply(SparseRows(torch.tensor([2, 7]), torch.ones(2, 3)))
    ids, rows, _ = store.changed_since(seen)
    assert sorted(ids.tolist()) == [2, 7]
    assert torch.equal(rows[torch.argsort(ids)], values[[2, 7]] - 0.5)
    assert store.changed_since(store.version)[0].numel() == 0  # nothing since the newest
    version = store.version
    store.apply(SparseRows(torch.empty(0, dtype=torch.int64), torch.empty(0, 3)))
    assert store.version == version and store.step == 2  # an empty update counts a step only
    store.apply(SparseRows(torch.tensor([5]), torch.ones(1, 3)))
    assert sorted(store.changed_since(seen)[0].tolist()) == [2, 5, 7]
    assert store.changed_since(version)[0].tolist() == [5]


def test_a_scan_in_chunks_covers_every_changed_row_once():
    store = _given_store(rows=23)
    ids = torch.arange(23)
    store.fill(ids, torch.randn(23, 3))
    seen = store.version
    touched = torch.tensor([0, 4, 5, 11, 17, 22])
    store.apply(SparseRows(touched, torch.ones(6, 3)))
    for since, expected in ((None, ids), (seen, touched)):
        got, start = [], 0
        while start is not None:
            chunk, _, start = store.changed_since(since, start, max_rows=4)
            assert chunk.numel() <= 4
            got += chunk.tolist()
        assert sorted(got) == expected.tolist()


def test_a_restored_store_is_another_incarnation_whose_versions_start_again():
    store = _given_store(rows=8, shard=1, shards=2)
    _filled(store)
    store.apply(SparseRows(torch.tensor([3]), torch.ones(1, 3)))
    restored = RowStore.decode(store.encode())
    assert restored.incarnation != store.incarnation and restored.version == 0
    assert restored.given and restored.complete
    ids, rows, _ = restored.changed_since(None)
    assert torch.equal(rows, store.pull(ids)) and sorted(ids.tolist()) == [1, 3, 5, 7]


def test_fill_refusals_change_nothing():
    store = _given_store()
    with pytest.raises(SparseGradientError, match=r"float32 \[rows, 3\].*float64"):
        store.fill(torch.tensor([0]), torch.ones(1, 3, dtype=torch.float64))
    with pytest.raises(SparseGradientError, match="out of range"):
        store.fill(torch.tensor([10]), torch.ones(1, 3))
    with pytest.raises(SparseGradientError, match="repeat"):
        store.fill(torch.tensor([1, 1]), torch.ones(2, 3))
    assert store.size == 0 and store.version == 0
    _filled(store)
    with pytest.raises(SparseGradientError, match="all its rows already.*overwrite"):
        store.fill(torch.tensor([0]), torch.ones(1, 3))
    lazy = RowStore(TableSpec("items", 10, 3), RowPartition(10, 1), 0, SGD)
    with pytest.raises(SparseGradientError, match="initializer.*only a table created from"):
        lazy.fill(torch.tensor([0]), torch.ones(1, 3))
    with pytest.raises(SparseGradientError, match="keeps no row versions"):
        lazy.changed_since(None)
    with pytest.raises(ConfigError, match="kind 'given' is for the ps's copy"):
        tfl.EmbeddingTable(10, 3, initializer=RowInitializer("given"))


def test_a_given_table_counts_its_row_versions_in_its_memory():
    assert table_shard_bytes(10, 12, 1, versioned=True) == table_shard_bytes(10, 12, 1) + 80
    assert _given_store().nbytes > 0


# -- over the wire ----------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, rows: int = 50, dim: int = 6, **options: object) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim, sparse=True, **options)
        self.head = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(-1)


@pytest.fixture
def shards() -> Iterator[list[RunningService]]:
    limits = Limits(max_message_bytes=64 << 10)  # small: the rows travel in several chunks
    config = [
        ServiceConfig(i, ("worker:0", "worker:1"), idle_timeout_s=60.0, limits=limits)
        for i in range(2)
    ]
    services = [serve_in_thread(c, SECRET) for c in config]
    try:
        yield services
    finally:
        stop_services(services)


def _updater(services, model: nn.Module, task: str = "worker:0", **options) -> PsUpdater:
    specs = [
        VariableSpec(n, tuple(p.shape), dtype_name(p.dtype), p.element_size())
        for n, p in model.named_parameters()
    ]
    return PsUpdater(
        [s.address for s in services],
        SECRET,
        task,
        is_chief=task == "worker:0",
        plan=plan_placement(specs, len(services)),
        discipline=options.pop("discipline", UpdateDiscipline(mode="async")),
        timeouts=TIMEOUTS,
        limits=Limits(max_message_bytes=64 << 10),
        **options,
    )


def _start(updater: PsUpdater, model: nn.Module) -> None:
    """Connect, wrap ``model``, register it with SGD and restore: the updater's life up to its
    first step (the chief fills the table; the others create it and wait)."""
    updater.connect()
    updater.wrap(model)
    updater.register(list(model.named_parameters()), tfl.optim.SGD(lr=0.1))
    updater.restore(None)


def _store(service: RunningService, name: str = "emb.weight") -> RowStore:
    return service.service.tables.tables.store(name)


def test_the_chief_creates_the_table_from_its_values_in_chunks_idempotently(shards):
    """A 5000 x 6 weight (120 kB) with 64 KiB messages: each shard's 2500 rows (60 kB) go in
    chunks of at most 32 KiB; the shards then hold the chief's values exactly. A second
    chief (restarted) finds the table complete and sends nothing; a worker's first pull
    takes every row, in chunks too, and equals the chief's weight."""
    torch.manual_seed(0)
    chief_model, other_model = Net(rows=5000), Net(rows=5000)
    chief = _updater(shards, chief_model)
    other = _updater(shards, other_model, "worker:1")
    fills: list[int] = []
    try:
        chief.connect()
        chief.wrap(chief_model)
        mirrored = chief.mirrored
        assert isinstance(mirrored, MirroredEmbeddings)
        sent = mirrored.source.fill_rows
        mirrored.source.fill_rows = lambda t, parts, direct=False: (
            fills.append(sum(p.nbytes for p in parts.values())),
            sent(t, parts, direct),
        )[1]
        chief.register(list(chief_model.named_parameters()), tfl.optim.SGD(lr=0.1))
        chief.restore(None)
        assert len(fills) == 3 and max(fills) <= 2 * (32 << 10)  # 3 chunks to each shard
        weight = chief_model.emb.weight.detach()
        for k, service in enumerate(shards):
            store = _store(service)
            assert store.complete and store.version == 3
            ids = torch.arange(k, 5000, 2)
            assert torch.equal(store.pull(ids), weight[ids])
        assert mirrored.weights[0].seen == [[_store(s).incarnation, 3] for s in shards]
        mirrored.create(is_chief=True)  # a chief that starts again: the table is complete
        assert len(fills) == 3 and _store(shards[0]).version == 3
        _start(other, other_model)
        assert not torch.equal(other_model.emb.weight, weight)
        before = other.mirrored.source.bytes_sent
        other.pull()
        assert torch.equal(other_model.emb.weight.detach(), weight)
        assert other.mirrored.source.bytes_sent - before == 5000 * (8 + 6 * 4)  # every row once
        other.pull()  # nothing changed since: no row travels
        assert other.mirrored.source.bytes_sent - before == 5000 * (8 + 6 * 4)
    finally:
        chief.close()
        other.close()


def test_a_shard_restarted_during_the_chiefs_first_fill_gets_the_whole_table_again(shards):
    """The chief fills a 5000-row table in chunks; shard 1 restarts (empty, same address)
    after the first chunk. Its table and rows are gone, so the chief recovers and creates and
    fills the table again from the start: both shards end with the chief's values, and the
    training starts."""
    torch.manual_seed(0)
    model = Net(rows=5000)
    chief = _updater(shards, model)
    restarted: list[RunningService] = []
    try:
        chief.connect()
        chief.wrap(model)
        source = chief.mirrored.source
        sent = source.fill_rows

        def fill_then_restart(table, parts, direct=False):  # noqa: ANN001, ANN202
            answer = sent(table, parts, direct)
            if not restarted:
                old = shards[1]
                stop_services([old])
                restarted.append(serve_in_thread(old.service.config, SECRET, old.address))
                shards[1] = restarted[0]  # the fixture stops it
            return answer

        source.fill_rows = fill_then_restart
        chief.register(list(model.named_parameters()), tfl.optim.SGD(lr=0.1))
        chief.restore(None)
        weight = model.emb.weight.detach()
        for k, service in enumerate(shards):
            store = _store(service)
            assert store.complete
            ids = torch.arange(k, 5000, 2)
            assert torch.equal(store.pull(ids), weight[ids])
        model.zero_grad()
        model(torch.tensor([1, 2, 3])).sum().backward()
        chief.exchange(0, None)  # a step goes through both shards
    finally:
        chief.close()


def test_another_incarnation_sends_every_row(shards):
    torch.manual_seed(1)
    model = Net()
    updater = _updater(shards, model)
    try:
        _start(updater, model)
        source, weight = updater.mirrored.source, updater.mirrored.weights[0]
        incarnation, version = weight.seen[0]
        known = source.pull_changed("emb.weight", {0: ([incarnation, version], 0)}, 100, 6)
        assert known[0].ids.numel() == 0 and known[0].next is None
        other = source.pull_changed("emb.weight", {0: ([incarnation + 1, version], 0)}, 100, 6)
        assert sorted(other[0].ids.tolist()) == list(range(0, 50, 2))  # ps:0's rows, all
        assert other[0].incarnation == incarnation
    finally:
        updater.close()


def test_refusals_name_the_parameter_and_the_fix_before_any_shard_changes(shards):
    model = Net()
    updater = _updater(shards, model)
    try:
        updater.connect()
        updater.wrap(model)
        with pytest.raises(SparseRuleError, match=r"'emb.weight'.*Adam.*sparse_optimizer="):
            updater.register(list(model.named_parameters()), tfl.optim.Adam(lr=0.1))
        with pytest.raises(SparseRuleError, match=r"'emb.weight'.*momentum"):
            updater.register(list(model.named_parameters()), tfl.optim.SGD(lr=0.1, momentum=0.9))
        assert shards[0].service.tables.tables is None  # nothing reached a shard
    finally:
        updater.close()
    for options, message in (
        ({"max_norm": 1.0}, r"'emb.weight'.*max_norm=1.0.*F.normalize"),
        ({"dtype": torch.float16}, r"'emb.weight'.*float16.*float32"),
    ):
        updater = _updater(shards, Net(**options))
        try:
            with pytest.raises(ConfigError, match=message):
                updater.wrap(Net(**options))
        finally:
            updater.close()
    updater = _updater(shards, model, discipline=UpdateDiscipline(mode="async", ema_decay=0.9))
    try:
        with pytest.raises(ConfigError, match=r"ema_decay.*'emb.weight'.*sparse=False"):
            updater.wrap(model)
    finally:
        updater.close()


def test_a_dense_gradient_of_a_mirrored_weight_is_refused_naming_it(shards):
    model = Net()
    updater = _updater(shards, model)
    try:
        _start(updater, model)
        (model.emb.weight.sum() + model(torch.tensor([1, 2])).sum()).backward()  # tied use
        with pytest.raises(
            SparseGradientError, match=r"'emb.weight'.*dense gradient.*sparse=False"
        ):
            updater.exchange(0, None)
    finally:
        updater.close()


def test_bad_pushes_are_refused_naming_the_table_and_the_shard_stays_up(shards):
    model = Net()
    updater = _updater(shards, model)
    try:
        _start(updater, model)
        source = updater.mirrored.source
        empty = SparseRows(torch.empty(0, dtype=torch.int64), torch.empty(0, 6))
        shard, piece = next((k, s[0]) for k, s in enumerate(updater.plan.shards) if s)
        dense_variable = piece.variable.name
        for parts, message in (
            ([SparseRows(torch.tensor([50]), torch.ones(1, 6)), empty], "id 50 is out of range"),
            ([SparseRows(torch.tensor([2]), torch.ones(1, 5)), empty], "dim 6.*dim 5"),
            (
                [SparseRows(torch.tensor([2]), torch.ones(1, 6, dtype=torch.float64)), empty],
                "float32.*float64",
            ),
        ):
            with pytest.raises(RemoteError, match=f"'emb.weight'.*{message}"):
                source.push_rows("emb.weight", parts)
        header, buffers = SparseRows(torch.tensor([0]), torch.ones(1, 1)).to_wire()
        body = {"task": "worker:0", "table": dense_variable, "gradient": header}
        with pytest.raises(RemoteError, match=f"{dense_variable!r}.*holds as a dense variable"):
            source._fanout().call("push_rows", body, 10.0, buffers=[buffers], shards=[shard])
        before = model.emb.weight.detach().clone()
        model(torch.tensor([4, 4, 9])).sum().backward()
        updater.exchange(0, None)  # the shards are up and unchanged by the refusals
        changed = (model.emb.weight.detach() != before).any(dim=1).nonzero().flatten()
        assert changed.tolist() == [4, 9]
    finally:
        updater.close()


def test_a_row_sparse_rule_goes_in_sparse_optimizer_and_only_with_ps():
    model = Net()
    with pytest.raises(ConfigTypeError, match="sparse_optimizer="):
        tfl.TrainingSession(None, model, optimizer=tfl.optim.SparseAdam(lr=0.1))
    session = tfl.TrainingSession(
        None, model, tfl.optim.SGD(lr=0.1), sparse_optimizer=tfl.optim.SparseAdam(lr=0.1)
    )
    # In one process it names the rule of the model's EmbeddingTables; this model has none.
    with pytest.raises(ConfigError, match="sparse_optimizer='sparse_adam': in one process"):
        session.start()


def test_mirror_weight_plans_rows_mod_shards():
    weight = mirror_weight("emb.weight", nn.Embedding(10, 2, sparse=True), 3)
    assert weight.partition.rows_on(0) == 4 and weight.spec.initializer.kind == "given"
    assert weight.seen == [None, None, None]
