"""A table's next lookup sent ahead with the step before's exchange
(:mod:`tensorfleet.worker.lookup_ahead`), on two real ps shards: the next forward takes the
answers without asking (no request, only the wait for what already travelled), the rows are
those a lookup would have read after the step's row push (bit for bit against one process),
a lookup of other ids drops them and asks (warned about when it repeats), a prefetch looked
up before any exchange sent it is taken back, a recovery since the sending makes the lookup
ask again, and in one process ``prefetch`` does nothing."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from tensorfleet.errors import UsageError
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.embedding_table import EmbeddingTable, TableNotAttached
from tensorfleet.worker.local_row_source import LocalRowSource
from tensorfleet.worker.ps_row_source import PsRowSource
from tensorfleet.worker.table_attachment import TableAttachment

from .service_harness import RunningService, worker_shards
from .test_rows_in_flight import CountingFanout

pytestmark = pytest.mark.timeout(60)
SECRET = b"lookup-ahead-unit-test-secret-00000000"
ROWS, DIM, STEPS = 1000, 4, 5


@pytest.fixture
def shards() -> Iterator[list[RunningService]]:
    with worker_shards(2, SECRET) as services:
        yield services


class Attached:
    """A table on the two shards through a counting fan-out that a test may swap (what a
    recovery does to the client's fan-out)."""

    def __init__(self, services: list[RunningService], rule: SparseRowRule) -> None:
        self.client = ParameterClient([s.address for s in services], SECRET, "worker:0")
        self.client.connect()
        self.fanout = CountingFanout(self.client._shards)
        self.recoveries: list[Exception] = []
        self.source = PsRowSource(
            lambda: self.fanout,
            self.client._recovering,
            "worker:0",
            self.client.timeouts.step_s,
            recover=self.recoveries.append,
        )
        self.table = EmbeddingTable(ROWS, DIM, name="items")
        self.tables = TableAttachment([("items", self.table)], self.source, 2)
        self.source.create(self.table.spec(), self.table.partition, rule)

    def step(self, ids: torch.Tensor, upcoming: torch.Tensor | None) -> None:
        """One async step as the session's exchange makes it: the forward and backward, the
        row push deferred, the lookup prefetched sent behind it, the pushes settled."""
        if upcoming is not None:
            self.table.prefetch(upcoming)
        (self.table(ids) ** 2).sum().backward()
        self.source.defer_pushes()
        self.tables.push()
        self.tables.send_lookups_ahead()
        self.source.settle_pushes()

    def close(self) -> None:
        self.client.close()


def _batches(count: int, seed: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ROWS, (64,), generator=generator) for _ in range(count)]


def test_the_next_forward_takes_the_rows_sent_ahead_without_asking(shards):
    rule = SparseRowRule("adagrad", {"lr": 0.1})
    reference = EmbeddingTable(ROWS, DIM, name="items")
    LocalRowSource([reference], num_shards=2, rule=rule)
    held = Attached(shards, rule)
    try:
        batches = _batches(STEPS + 1)
        for step in range(STEPS):
            held.fanout.requests.clear(), held.fanout.waits.clear()
            held.fanout.calls = 0
            held.step(batches[step], batches[step + 1])
            if step > 0:  # the lookup took the answers sent ahead: no request, no fan-out
                assert held.fanout.calls == 0
                assert held.fanout.requests[(0, "pull_rows")] == 1  # the next one, ahead
                assert held.fanout.requests[(1, "pull_rows")] == 1
                assert held.fanout.waits == Counter({0: 2, 1: 2})  # the rows ahead, the push
            (reference(batches[step]) ** 2).sum().backward()
            reference.push_gradient()
        assert held.table.lookups_ahead == {"used": STEPS - 1, "missed": 0, "lost": 0}
        with torch.no_grad():  # takes (and misses) the last prefetch: the rows are right
            got, want = held.table(torch.arange(ROWS)), reference(torch.arange(ROWS))
        assert torch.equal(got, want)  # the same updates, bit for bit
        assert held.table.lookups_ahead["missed"] == 1
    finally:
        held.close()


def test_rows_sent_ahead_carry_the_update_of_the_push_before_them(shards):
    held = Attached(shards, SparseRowRule("sgd", {"lr": 1.0}))
    try:
        ids = torch.tensor([1, 2, 501, 777])
        with torch.no_grad():
            before = held.table(ids).clone()
        held.table(ids).sum().backward()  # a gradient of ones: each row moves by -1
        held.table.prefetch(ids)  # after this step's lookup: the next one's
        held.source.defer_pushes()
        held.tables.push()
        held.tables.send_lookups_ahead()  # sent behind the push on the same channels
        with torch.no_grad():
            after = held.table(ids)
        held.source.settle_pushes()
        assert held.table.lookups_ahead["used"] == 1
        assert torch.equal(after, before - 1.0)
    finally:
        held.close()


def test_a_lookup_of_other_ids_drops_the_rows_ahead_and_asks_warning_when_it_repeats(
    shards, caplog
):
    held = Attached(shards, SparseRowRule("sgd", {"lr": 0.5}))
    try:
        a, b, c = _batches(3, seed=5)
        with caplog.at_level(logging.WARNING, logger="tensorfleet.worker"):
            held.step(a, upcoming=c)  # the script prefetches the wrong batch
            held.step(b, upcoming=c)
            assert held.table.lookups_ahead == {"used": 0, "missed": 1, "lost": 0}
            assert "prefetched" not in caplog.text  # once: a run's last prefetch is missed too
            held.step(a, upcoming=None)
        assert held.table.lookups_ahead == {"used": 0, "missed": 2, "lost": 0}
        assert caplog.text.count("the rows prefetched were not those of its next lookup") == 1
        assert "'items'" in caplog.text and "fix: call table.prefetch(ids)" in caplog.text
        with torch.no_grad():  # every lookup asked for its own rows: they are current
            fresh = held.source.pull_rows_of("items", {0: torch.tensor([0]), 1: torch.tensor([1])})
            assert torch.equal(held.table(torch.tensor([0, 1])), torch.cat([fresh[0], fresh[1]]))
    finally:
        held.close()


def test_a_prefetch_looked_up_before_any_exchange_is_taken_back(shards):
    held = Attached(shards, SparseRowRule("sgd", {"lr": 0.5}))
    try:
        ids = torch.tensor([3, 4, 600])
        held.table.prefetch(ids)  # after the step, i.e. before this lookup: nothing sent
        held.fanout.requests.clear()
        held.step(ids, upcoming=None)
        assert held.fanout.requests[(0, "pull_rows")] == 1  # the lookup's own, not twice
        assert held.fanout.requests[(1, "pull_rows")] == 1
        assert held.table.lookups_ahead == {"used": 0, "missed": 0, "lost": 0}
    finally:
        held.close()


def test_a_lookup_sent_ahead_lost_to_a_recovery_is_asked_again(shards):
    held = Attached(shards, SparseRowRule("sgd", {"lr": 0.5}))
    try:
        a, b = _batches(2, seed=7)
        held.step(a, upcoming=b)
        held.fanout = CountingFanout(held.client._shards)  # as a recovery replaces it
        with torch.no_grad():
            rows = held.table(b)
        assert held.table.lookups_ahead == {"used": 0, "missed": 0, "lost": 1}
        assert held.fanout.requests[(0, "pull_rows")] + held.fanout.requests[(1, "pull_rows")]
        with torch.no_grad():
            assert torch.equal(rows, held.table(b))
    finally:
        held.close()


def test_prefetch_checks_the_ids_and_needs_an_attached_table(shards):
    held = Attached(shards, SparseRowRule("sgd", {"lr": 0.5}))
    try:
        with pytest.raises(Exception, match=r"id 1000 is out of range \[0, 1000\)"):
            held.table.prefetch(torch.tensor([1, ROWS]))
        held.table.release("the ps shards")
        with pytest.raises(UsageError, match="session that held them has ended"):
            held.table.prefetch(torch.tensor([1]))
    finally:
        held.close()
    with pytest.raises(TableNotAttached):
        EmbeddingTable(ROWS, DIM, name="loose").prefetch(torch.tensor([1]))


def test_in_one_process_prefetch_does_nothing():
    table = EmbeddingTable(ROWS, DIM, name="items")
    LocalRowSource([table], num_shards=2, rule=SparseRowRule("sgd", {"lr": 0.5}))
    table.prefetch(torch.tensor([1, 2, 3]))
    table.send_ahead()
    assert table(torch.tensor([1, 2, 3])).shape == (3, DIM)
    assert table.lookups_ahead == {"used": 0, "missed": 0, "lost": 0}
