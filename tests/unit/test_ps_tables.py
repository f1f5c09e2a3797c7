"""Embedding tables served by real ps shards over the wire (``table_create``, ``pull_rows``,
``push_rows``) through a worker's ``PsRowSource``: a table row-partitioned over two shards
trains like the same table held dense in one process; ``max_memory`` refuses a table that
does not fit, naming it, and the shard stays up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tensorfleet.errors import RemoteError
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.embedding_table import EmbeddingTable, LocalRowSource
from tensorfleet.worker.ps_row_source import PsRowSource

from .service_harness import RunningService, serve_in_thread, stop_services

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
    services = [
        serve_in_thread(ServiceConfig(i, ("worker:0",), idle_timeout_s=60.0), SECRET)
        for i in range(2)
    ]
    try:
        yield services
    finally:
        stop_services(services)


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
