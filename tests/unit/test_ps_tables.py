"""Embedding tables served by real ps shards over the wire (``table_create``, ``pull_rows``,
``push_rows``) through a worker's ``PsRowSource``: a table row-partitioned over two shards
trains like the same table held dense in one process; ``max_memory`` refuses a table that
does not fit, naming it, and the shard stays up."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import tensorfleet as tfl
from tensorfleet.errors import RemoteError
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.embedding_table import EmbeddingTable
from tensorfleet.worker.local_row_source import LocalRowSource
from tensorfleet.worker.ps_row_source import PsRowSource

from .service_harness import RunningService, serve_in_thread, stop_services, worker_shards

pytestmark = pytest.mark.timeout(60)
SECRET = b"ps-tables-unit-test-secret-00000000000"
ROWS, DIM, STEPS = 1000, 4, 5


def _source(services: list[RunningService]) -> tuple[ParameterClient, PsRowSource]:
    client = ParameterClient([s.address for s in services], SECRET, "worker:0")
    client.connect()
    source = PsRowSource(
        lambda: client._shards, client._recovering, "worker:0", client.timeouts.step_s
    )
    return client, source


@pytest.fixture
def shards() -> Iterator[list[RunningService]]:
    with worker_shards(2, SECRET) as services:
        yield services


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, ROWS, (32,), generator=generator) for _ in range(STEPS)]


def _target() -> torch.Tensor:
    return torch.linspace(-1, 1, DIM)


def test_a_table_on_two_shards_trains_like_the_table_held_dense(shards):
    rule = SparseRowRule("adagrad", {"lr": 0.1})
    # The dense reference: the same initial rows in one nn.Embedding(sparse=True) + Adagrad.
    initial = EmbeddingTable(ROWS, DIM, name="items")
    LocalRowSource([initial], num_shards=1, rule=rule)
    dense = torch.nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        dense.weight.copy_(initial(torch.arange(ROWS)))
    optimizer = torch.optim.Adagrad(dense.parameters(), lr=0.1)

    client, source = _source(shards)
    try:
        table = EmbeddingTable(ROWS, DIM, name="items")
        table.attach(source, num_shards=2)
        assert source.create(table.spec(), table.partition, rule) is True
        assert source.create(table.spec(), table.partition, rule) is False  # idempotent
        for ids in _batches():
            ((table(ids) - _target()) ** 2).sum().backward()
            table.push_gradient()  # its rows, split by shard, through PsRowSource.push_rows
            optimizer.zero_grad()
            ((dense(ids) - _target()) ** 2).sum().backward()
            optimizer.step()
        with torch.no_grad():
            held = table(torch.arange(ROWS))
        difference = (held - dense.weight.detach()).abs().max().item()
        assert difference < 1e-6, f"|ps table - dense| = {difference}"
        touched = torch.unique(torch.cat(_batches()))
        assert not torch.equal(held[touched], initial(touched).detach())  # it did train
        assert source.bytes_sent < ROWS * DIM * 4 * STEPS  # only touched rows travelled
    finally:
        client.close()


def test_max_memory_refuses_a_table_that_does_not_fit_and_the_shard_stays_up():
    config = ServiceConfig(0, ("worker:0",), idle_timeout_s=60.0, max_memory=10_000)
    services = [serve_in_thread(config, SECRET)]
    client, source = _source(services)
    try:
        big = EmbeddingTable(100_000, 16, name="too_big")
        big.attach(source, num_shards=1)
        with pytest.raises(RemoteError, match="too_big"):
            source.create(big.spec(), big.partition, SparseRowRule("sgd"))
        small = EmbeddingTable(10, 4, name="small")
        small.attach(source, num_shards=1)
        assert source.create(small.spec(), small.partition, SparseRowRule("sgd")) is True
        assert small(torch.tensor([1, 2])).shape == (2, 4)
    finally:
        client.close()
        stop_services(services)


def test_max_memory_is_a_server_option_checked_up_front():
    from tensorfleet.launch.cli import _memory_size
    from tensorfleet.session.server import ServerConfig

    assert _memory_size("512MiB") == 512 << 20 and _memory_size(None) is None
    assert ServerConfig(max_memory=1 << 30).max_memory == 1 << 30
    with pytest.raises(ValueError, match="max_memory must be > 0"):
        ServerConfig(max_memory=0)
    with pytest.raises(ValueError, match="is not a size"):
        _memory_size("lots")


def test_a_shards_tables_travel_in_its_checkpoint_document_and_restore():
    from tensorfleet.ps.layout import FusedLayout, StoredVariable
    from tensorfleet.ps.shard_checkpoint import decode_shard, encode_shard
    from tensorfleet.ps.table_requests import TableRequests

    table = EmbeddingTable(ROWS, DIM, name="items")
    local = LocalRowSource([table], num_shards=2, rule=SparseRowRule("adagrad", {"lr": 0.1}))
    for ids in _batches():
        ((table(ids) - _target()) ** 2).sum().backward()
        table.push_gradient()
    saved = local.shards[1].save()
    document = encode_shard(
        shard=1, global_step=5, version=5, rule={"name": "sgd"},
        layout=FusedLayout.of([StoredVariable("w", (2,), "float32")]),
        values={"w": torch.zeros(2)}, ema=None, optimizer={}, worker_data={}, tables=saved,
    )  # fmt: skip
    state = decode_shard(document)
    assert state.tables == saved
    restarted = TableRequests(socket=None, shard=1, max_memory=None)  # a fresh, empty shard
    restarted.restore(state.tables)
    ids = table.partition.rows_of(1)[:50] if hasattr(table.partition, "rows_of") else None
    ids = torch.arange(1, ROWS, 2) if ids is None else ids
    assert torch.equal(restarted.tables.pull("items", ids), local.shards[1].pull("items", ids))
    with pytest.raises(ValueError, match="the checkpoint's tables"):
        TableRequests(None, 0, None).restore({"items": saved["items"]})  # ps:1's rows on ps:0


def test_the_ps_log_names_each_table_its_rows_bytes_and_rule_and_stats_count_them(shards, caplog):
    """A shard holding only table rows used to log '0 variables created (0 bytes), rule
    adagrad' and nothing on its tables; now each table's creation is a line naming its rows
    there, their bytes and its rule, and ``stats`` (``cluster_stats()``) carries each
    table's numbers and the shard's peak RSS."""
    client, source = _source(shards)
    try:
        table = EmbeddingTable(ROWS, DIM, name="items")
        table.attach(source, num_shards=2)
        with caplog.at_level(logging.INFO, logger="tensorfleet.ps"):
            source.create(table.spec(), table.partition, SparseRowRule("sparse_adam"))
            source.create(table.spec(), table.partition, SparseRowRule("sparse_adam"))
        lines = [r.getMessage() for r in caplog.records if "table 'items'" in r.getMessage()]
        assert len(lines) == 2, lines  # one per shard, not one per request
        assert any(
            line.startswith("ps:1: created table 'items': 500 of 1,000 rows") for line in lines
        )
        assert all("rule sparse_adam" in line and " B held now" in line for line in lines)
        table(torch.tensor([1, 2, 3]))
        stats = client.stats()
        assert [s["tables"]["items"]["rows_live"] for s in stats] == [1, 2]
        assert all(s["tables"]["items"]["rule"] == "sparse_adam" for s in stats)
        assert all(s["peak_rss_bytes"] > 1 << 20 for s in stats)
    finally:
        client.close()


class _TableModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = EmbeddingTable(ROWS, DIM)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids)).squeeze(-1)


def test_a_lookup_after_the_cluster_session_ended_is_a_usage_error_naming_the_fix(shards):
    """The chief evaluating with its tables after the session's ``with`` block: the rows
    were on the ps shards, which end with the training; the lookup talked to closed
    channels. It is a UsageError naming the fix (evaluate inside the block, or read the
    checkpoint's rows)."""
    from tensorfleet.ps.placement import VariableSpec, plan_placement
    from tensorfleet.ps.update_discipline import UpdateDiscipline
    from tensorfleet.ps.update_rules import UpdateRule
    from tensorfleet.wire.tensors import dtype_name
    from tensorfleet.worker.ps_updater import PsUpdater

    model = _TableModel()
    specs = [
        VariableSpec(n, tuple(p.shape), dtype_name(p.dtype), p.element_size())
        for n, p in model.named_parameters()
    ]
    updater = PsUpdater(
        [s.address for s in shards],
        SECRET,
        "worker:0",
        is_chief=True,
        plan=plan_placement(specs, 2),
        discipline=UpdateDiscipline(mode="async"),
    )
    try:
        updater.connect()
        updater.wrap(model)
        updater.register(list(model.named_parameters()), UpdateRule("sgd", {"lr": 0.1}))
        updater.restore(None)
        updater.pull()
        model(torch.tensor([1, 2, 3])).sum().backward()
        updater.exchange(0, None)
        with torch.no_grad():
            assert model(torch.tensor([1, 2])).shape == (2,)  # inside: the shards answer
    finally:
        updater.close()
    with pytest.raises(tfl.UsageError, match="load_table_rows") as refused:
        with torch.no_grad():
            model(torch.tensor([1, 2]))
    assert "'embedding'" in str(refused.value) and "inside the `with` block" in str(refused.value)


def test_the_memory_limit_goes_from_the_launcher_to_every_ps(monkeypatch: pytest.MonkeyPatch):
    """``tensorfleet launch --ps-max-memory`` (a ps command of the launcher's own cannot be
    given --max-memory otherwise) sets the variable that ``tensorfleet server`` defaults to."""
    from tensorfleet import environment
    from tensorfleet.errors import ConfigError
    from tensorfleet.launch.cli import build_parser, server_config_fields
    from tensorfleet.launch.launch_command import launch_env

    parser = build_parser()
    launch = ["launch", "--ps-update-log", "off", "--ps-max-memory"]
    env = launch_env(parser.parse_args([*launch, "512MiB", "--", "python", "t.py"]))
    assert env[environment.PS_MAX_MEMORY_VAR] == "512MiB"
    with pytest.raises(ConfigError, match="--ps-max-memory '1Q' is not a size"):
        launch_env(parser.parse_args([*launch, "1Q", "--", "python", "t.py"]))
    monkeypatch.setenv(environment.PS_MAX_MEMORY_VAR, "512MiB")
    assert server_config_fields(parser.parse_args(["server"]))["max_memory"] == 512 << 20
    fields = server_config_fields(parser.parse_args(["server", "--max-memory", "1GiB"]))
    assert fields["max_memory"] == 1 << 30  # the option wins
    monkeypatch.setenv(environment.PS_MAX_MEMORY_VAR, "1Q")  # named as the variable
    with pytest.raises(ConfigError, match="TENSORFLEET_PS_MAX_MEMORY '1Q' is not a size"):
        server_config_fields(parser.parse_args(["server"]))
