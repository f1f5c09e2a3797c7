"""The round trips of a step with an embedding table on two real ps shards: the lookup asks
both shards in one fan-out (one wait, not one per shard), the row gradients are sent without
waiting while pushes are deferred (:mod:`tensorfleet.worker.rows_in_flight`) and are applied
before the next request on the same channel, exactly as when the worker waited; a malformed
lookup reply and a refused row push in flight are clear errors."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from tensorfleet.errors import ProtocolError, RemoteError
from tensorfleet.ps.sparse_rows import SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.wire.channel import Reply
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.embedding_table import EmbeddingTable
from tensorfleet.worker.local_row_source import LocalRowSource
from tensorfleet.worker.ps_row_source import PsRowSource
from tensorfleet.worker.shard_fanout import ShardFanout

from .service_harness import RunningService, worker_shards

pytestmark = pytest.mark.timeout(60)
SECRET = b"rows-in-flight-unit-test-secret-000000"
ROWS, DIM, STEPS = 1000, 4, 4


class CountingFanout(ShardFanout):
    """A fan-out that counts, per shard, the requests sent and the waits for replies."""

    def __init__(self, inner: ShardFanout) -> None:
        super().__init__(inner.channels, inner._heartbeat, inner.request_fields)
        self.requests: Counter[tuple[int, str]] = Counter()
        self.waits: Counter[int] = Counter()
        self.calls = 0

    def call(self, op, body, timeout_s, buffers=None, shards=None, **kwargs):  # type: ignore[override]
        targets = list(range(self.num_shards)) if shards is None else list(shards)
        for shard in targets:
            self.requests[(shard, op)] += 1
            self.waits[shard] += 1
        self.calls += 1
        return super().call(op, body, timeout_s, buffers=buffers, shards=shards, **kwargs)

    def send(self, shard, op, body, timeout_s, buffers=None):  # type: ignore[override]
        self.requests[(shard, op)] += 1
        return super().send(shard, op, body, timeout_s, buffers)

    def wait(self, shard, request_id, timeout_s):  # type: ignore[override]
        self.waits[shard] += 1
        return super().wait(shard, request_id, timeout_s)


@pytest.fixture
def shards() -> Iterator[list[RunningService]]:
    with worker_shards(2, SECRET) as services:
        yield services


def _attached(services: list[RunningService], rule: SparseRowRule):
    client = ParameterClient([s.address for s in services], SECRET, "worker:0")
    client.connect()
    fanout = CountingFanout(client._shards)
    source = PsRowSource(lambda: fanout, client._recovering, "worker:0", client.timeouts.step_s)
    table = EmbeddingTable(ROWS, DIM, name="items")
    table.attach(source, num_shards=2)
    source.create(table.spec(), table.partition, rule)
    return client, fanout, source, table


def test_a_step_waits_once_for_the_lookup_of_both_shards_and_not_for_its_rows(shards):
    rule = SparseRowRule("adagrad", {"lr": 0.1})
    reference = EmbeddingTable(ROWS, DIM, name="items")
    LocalRowSource([reference], num_shards=2, rule=rule)
    client, fanout, source, table = _attached(shards, rule)
    try:
        generator = torch.Generator().manual_seed(3)
        for _ in range(STEPS):
            ids = torch.randint(0, ROWS, (64,), generator=generator)
            fanout.requests.clear(), fanout.waits.clear()
            fanout.calls = 0
            source.defer_pushes()
            (table(ids) ** 2).sum().backward()
            table.push_gradient()
            # Before the replies are awaited: one fan-out (the lookup of both shards), and
            # one row push sent to each shard with nobody waiting for it yet.
            assert fanout.calls == 1
            assert fanout.waits == Counter({0: 1, 1: 1})
            assert fanout.requests == Counter(
                {(0, "pull_rows"): 1, (1, "pull_rows"): 1, (0, "push_rows"): 1, (1, "push_rows"): 1}
            )
            source.settle_pushes()
            assert fanout.waits == Counter({0: 2, 1: 2})  # the rows' replies, taken together
            (reference(ids) ** 2).sum().backward()
            reference.push_gradient()
        with torch.no_grad():
            held, expected = table(torch.arange(ROWS)), reference(torch.arange(ROWS))
        # The same initial rows (seeded by table and row) and the same updates, bit for bit.
        assert torch.equal(held, expected)
        assert source.dropped_pushes == 0
    finally:
        client.close()


def test_rows_in_flight_are_applied_before_the_next_request_on_the_channel(shards):
    client, fanout, source, table = _attached(shards, SparseRowRule("sgd", {"lr": 1.0}))
    try:
        ids = torch.tensor([1, 2, 501, 777])
        with torch.no_grad():
            before = table(ids).clone()
        source.defer_pushes()
        table(ids).sum().backward()
        table.push_gradient()  # sent, not awaited
        with torch.no_grad():
            after = table(ids)  # asked on the same channels, answered after the rows
        assert torch.equal(after, before - 1.0)
        source.settle_pushes()
    finally:
        client.close()


def test_a_refused_row_push_in_flight_is_raised_by_settle_naming_the_reason(shards):
    client, fanout, source, table = _attached(shards, SparseRowRule("sgd", {"lr": 1.0}))
    try:
        source.defer_pushes()
        bad = SparseRows(torch.tensor([ROWS + 5]), torch.ones(1, DIM))  # past the table's rows
        empty = SparseRows(torch.empty(0, dtype=torch.int64), torch.empty(0, DIM))
        source.push_rows("items", [bad, empty])
        with pytest.raises(RemoteError, match="items|row|id"):
            source.settle_pushes()
        with torch.no_grad():  # the shards stay up and answer
            assert table(torch.tensor([0, 999])).shape == (2, DIM)
    finally:
        client.close()


@pytest.mark.parametrize(
    ("buffers", "match"),
    [
        ([], "0 buffers"),
        ([b"\x00" * 7], "7 bytes"),
        ([b""], "0 bytes"),
    ],
)
def test_a_malformed_lookup_reply_is_refused_naming_the_shard(buffers, match):
    source = PsRowSource(lambda: None, lambda attempt: attempt(), "worker:0", 1.0)  # type: ignore[arg-type,return-value]
    with pytest.raises(ProtocolError, match=f"ps:1 .*{match}"):
        source._rows_of_reply(1, Reply({}, list(buffers)), torch.float32, 2)


def test_a_lookup_reply_of_the_wrong_width_is_refused_by_the_table():
    class WrongWidth:
        def pull_rows_of(self, table, parts):
            return {k: torch.zeros(ids.numel(), DIM + 1) for k, ids in parts.items()}

    table = EmbeddingTable(ROWS, DIM, name="items")
    table.attach(WrongWidth(), num_shards=2)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=r"ps:\d answered the lookup .* not \(\d+, 4\)"):
        table(torch.tensor([1, 700]))
