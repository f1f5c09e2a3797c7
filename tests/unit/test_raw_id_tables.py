"""Tables of raw int64 ids (``tfl.EmbeddingTable(..., ids="raw", admit_after=N,
expire_after_steps=T)``, ``ps/raw_id_rows.py``): a row per admitted id, never shared, over
the whole int64 range; admission after N updates carried an id (zeros and dropped gradients
before); eviction of rows and counts not seen for T updates, with their slots; checkpoints
that restore the state bit for bit; on two real ps shards (in threads) in sync and async
training, the shards' state equals the same rules applied in one process, bit for bit,
after every step; and a one-process TrainingSession trains, checkpoints and restores one.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.errors import ConfigError
from tensorfleet.ps.held_row_gradients import mean_rows
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.raw_id_rows import RawIdRowStore, decode_store
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.shard_checkpoint import decode_shard
from tensorfleet.ps.sparse_rows import SparseGradientError, SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.table_requests import TableRequests
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.session.checkpoints import CheckpointDirectory
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.worker.embedding_table import EmbeddingTable
from tensorfleet.worker.local_row_source import LocalRowSource
from tensorfleet.worker.ps_updater import PsUpdater
from tensorfleet.worker.timeouts import ClientTimeouts

from .service_harness import RunningService, serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(120)
SECRET = b"raw-id-tables-unit-test-secret-000000000"
TIMEOUTS = ClientTimeouts(connect_s=10.0, initialize_s=20.0, step_s=20.0, recover_s=30.0)
DIM, ADMIT, EXPIRE, CAPACITY, STEPS = 4, 2, 3, 64, 14
RULE = SparseRowRule("adagrad", {"lr": 0.2})
I64 = torch.iinfo(torch.int64)
#: Ids over the whole int64 range, both ends included: 6 frequent, 10 rare.
VOCAB = torch.cat(
    [
        torch.tensor([I64.min, I64.max, 0, -1], dtype=torch.int64),
        torch.randint(I64.min, I64.max, (12,), generator=torch.Generator().manual_seed(3)),
    ]
)


def _batch(step: int, worker: int) -> torch.Tensor:
    """Frequent ids every step; each rare id in three steps in a row (admitted, then
    expired when its steps stop); one id seen once (counted, never admitted, forgotten)."""
    generator = torch.Generator().manual_seed(1000 * step + worker)
    frequent = VOCAB[torch.randint(0, 6, (5,), generator=generator)]
    rare = VOCAB[6 + (step // 3 + worker * 5 + torch.arange(2)) % 10]
    once = torch.randint(I64.min, I64.max, (1,), generator=generator)
    return torch.cat([frequent, rare, once])


def _table(
    name: str = "users", admission_filter: tfl.AdmissionFilter | None = None
) -> EmbeddingTable:
    return EmbeddingTable(
        CAPACITY,
        DIM,
        name=name,
        ids="raw",
        admit_after=ADMIT,
        expire_after_steps=EXPIRE,
        initializer=tfl.RowInitializer("normal", 1.0, seed=4),
        rule=RULE,
        admission_filter=admission_filter,
    )


#: A filter small enough that ids share counters (some are admitted early).
SMALL_FILTER = tfl.AdmissionFilter(expected_ids=8, false_positive_rate=0.2)


class Net(nn.Module):
    def __init__(self, admission_filter: tfl.AdmissionFilter | None = None) -> None:
        super().__init__()
        self.users = _table(admission_filter=admission_filter)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.users(ids)).squeeze(-1)


def _loss(model: Net, ids: torch.Tensor) -> torch.Tensor:
    target = (ids % 3).float()
    return F.mse_loss(model(ids), target)


def _assert_same_state(got: RawIdRowStore, want: RawIdRowStore, context: object) -> None:
    a, b = got.state(), want.state()
    assert a.keys() == b.keys(), context
    for key in a:
        assert torch.equal(a[key], b[key]), (context, key, a[key], b[key])
    assert got.counters == want.counters, (context, got.counters, want.counters)


def _assert_no_shared_rows(store: RawIdRowStore) -> None:
    """Every row belongs to one id: positions distinct, each row's id its key."""
    admitted = store._pos >= 0
    positions = store._pos[admitted]
    assert positions.unique().numel() == positions.numel()
    assert torch.equal(store._ids[positions], store._keys[admitted])
    assert int(admitted.sum()) == store.size
    assert bool((store._values[store.size :] == 0).all())  # evicted rows do not linger
    for slot in store._slots.values():
        assert bool((slot[store.size :] == 0).all())


# -- the store alone ----------------------------------------------------------------------------


def test_admission_after_n_updates_zeros_before_and_dropped_gradients_counted() -> None:
    table = _table()
    source = LocalRowSource([table], num_shards=1)
    store = source.shards[0].store("users")
    ids = torch.tensor([I64.min, I64.max, 7], dtype=torch.int64)
    for update in range(1, ADMIT + 1):
        looked_up = table(ids)
        assert bool((looked_up == 0).all()), update  # no row yet: zeros
        looked_up.sum().backward()
        table.push_gradient()
        assert store.counters["dropped_rows"] == 3 * update
    assert store.size == 3 and store.counters["admitted"] == 3
    with torch.no_grad():
        rows = table(ids)
    want = table.initializer.rows(torch.sort(ids).values, DIM, torch.float32, raw_ids=True)
    assert torch.equal(rows[torch.argsort(ids)], want)  # the initializer's rows, untrained
    _assert_no_shared_rows(store)


def test_expiry_evicts_rows_and_slots_and_a_returning_id_starts_over() -> None:
    table = _table()
    source = LocalRowSource([table], num_shards=1)
    store = source.shards[0].store("users")
    kept, dropped = torch.tensor([5]), torch.tensor([I64.max])
    both = torch.cat([kept, dropped])
    for _ in range(ADMIT + 1):  # both admitted, then trained once
        table(both).pow(2).sum().backward()
        table.push_gradient()
    assert store.size == 2 and store.stats()["rows_live"] == 2
    for step in range(EXPIRE):
        table(kept).pow(2).sum().backward()
        table.push_gradient()
        assert (store.size == 2) == (step < EXPIRE - 1), step
    assert store.counters["evicted"] == 1
    assert I64.max not in store._keys.tolist()  # its count is gone too
    assert torch.equal(store.created_rows(), kept)
    assert set(store.state()) == {"ids", "values", "keys", "count", "last_seen", "step", "slot/sum"}
    assert store.state()["slot/sum"].shape == (1, DIM)  # its Adagrad sum went with it
    _assert_no_shared_rows(store)
    with torch.no_grad():
        assert bool((table(dropped) == 0).all())  # back to zeros: admission starts over


def test_ids_over_the_whole_int64_range_never_share_a_row_and_the_capacity_holds() -> None:
    table = EmbeddingTable(1000, 2, name="wide", ids="raw", rule=SparseRowRule("sgd"))
    source = LocalRowSource([table], num_shards=2)
    ids = torch.randint(I64.min, I64.max, (3000,), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([ids, torch.tensor([I64.min, I64.max, 0, -1])]).unique()
    table(ids[:800])  # admit_after=0: a row at the first training lookup
    stores = [shard.store("wide") for shard in source.shards]
    assert sum(s.size for s in stores) == 800
    for store in stores:
        _assert_no_shared_rows(store)
    held = torch.sort(torch.cat([s.created_rows() for s in stores])).values
    assert torch.equal(held, torch.sort(ids[:800]).values)
    table(ids)  # more ids than the capacity: each shard stops at its 500 rows
    assert [s.size for s in stores] == [500, 500]
    assert sum(s.counters["deferred"] for s in stores) == ids.numel() - 1000


def test_a_checkpoint_document_restores_the_state_bit_for_bit() -> None:
    table = _table()
    source = LocalRowSource([table], num_shards=2)
    for step in range(STEPS):
        _loss_of_table(table, _batch(step, 0)).backward()
        table.push_gradient()
    for shard in source.shards:
        store = shard.store("users")
        restored = decode_store(store.encode(), expect=store.table)
        assert isinstance(restored, RawIdRowStore)
        _assert_same_state(restored, store, shard.shard)
    assert sum(s.store("users").counters["evicted"] for s in source.shards) > 0


def _loss_of_table(table: EmbeddingTable, ids: torch.Tensor) -> torch.Tensor:
    return (table(ids).sum(-1) - (ids % 3).float()).pow(2).mean()


def test_raw_table_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="ids must be 'rows'"):
        EmbeddingTable(10, 2, ids="strings")
    # only what was given is named (partition='mod' is the default, not the user's choice)
    with pytest.raises(
        ConfigError, match="hash picks; hash_ids=True does not apply; fix: leave it"
    ):
        EmbeddingTable(10, 2, ids="raw", hash_ids=True)
    with pytest.raises(ConfigError, match="hash_ids=True and partition='range' do not apply"):
        EmbeddingTable(10, 2, ids="raw", hash_ids=True, partition="range")
    with pytest.raises(ConfigError, match="admit_after must be an int >= 0"):
        EmbeddingTable(10, 2, ids="raw", admit_after=-1)
    with pytest.raises(ConfigError, match="expire_after_steps must be an int >= 1"):
        EmbeddingTable(10, 2, ids="raw", expire_after_steps=0)
    with pytest.raises(ConfigError, match="apply to tables of raw ids"):
        EmbeddingTable(10, 2, admit_after=2)


def test_raw_ids_of_another_dtype_are_refused_with_the_fix_for_that_dtype() -> None:
    table = EmbeddingTable(10, 2, name="users", ids="raw")
    with pytest.raises(SparseGradientError) as refused:
        table.rows_of(torch.tensor([1.0, 2.0]))
    message = str(refused.value)
    assert "ids must be an int64, uint64 or int32 tensor, got torch.float32" in message
    assert "ids.long()" in message
    with pytest.raises(SparseGradientError, match="got list; fix: map strings to int64"):
        table.rows_of(["a", "b"])


# -- two real shards, sync and async, against one process ----------------------------------------


@pytest.fixture
def shards() -> Iterator[Callable[..., list[RunningService]]]:
    started: list[RunningService] = []

    def start(count: int, workers: tuple[str, ...]) -> list[RunningService]:
        for i in range(count):
            config = ServiceConfig(i, workers, idle_timeout_s=60.0, liveness_timeout_s=60.0)
            started.append(serve_in_thread(config, SECRET))
        return started

    try:
        yield start
    finally:
        stop_services(started)


class _Recording:
    """A worker table's row source that records the parts it pushes (for the reference)."""

    def __init__(self, inner: object) -> None:
        self.inner, self.pushed = inner, []

    def pull_rows(
        self, table: str, shard: int, ids: torch.Tensor, read_only: bool = False
    ) -> torch.Tensor:
        return self.inner.pull_rows(table, shard, ids, read_only)

    def push_rows(self, table: str, parts: Sequence[SparseRows]) -> None:
        self.pushed.append([SparseRows(p.indices.clone(), p.values.clone()) for p in parts])
        self.inner.push_rows(table, parts)


def _updater(services: list[RunningService], model: Net, task: str, mode: str) -> PsUpdater:
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
        discipline=UpdateDiscipline(mode="async", max_staleness=1)
        if mode == "max_staleness"
        else UpdateDiscipline(mode=mode),
        timeouts=TIMEOUTS,
    )


def _start(updater: PsUpdater, model: Net) -> _Recording:
    updater.connect()
    updater.wrap(model)
    updater.register(list(model.named_parameters()), UpdateRule("sgd", {"lr": 0.1}))
    updater.restore(None)
    updater.pull()
    recording = _Recording(model.users._source)
    model.users._source = recording
    return recording


def _in_threads(calls: list[Callable[[], object]]) -> None:
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60.0)
    assert not any(t.is_alive() for t in threads), "a worker did not finish its call"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("admission_filter", [None, SMALL_FILTER], ids=["exact", "filter"])
@pytest.mark.parametrize("mode", ["sync", "async", "max_staleness"])
def test_two_shards_equal_one_process_with_the_same_rules_bit_for_bit(
    shards, mode, admission_filter, tmp_path, caplog
):
    """Two workers over two shards, ids over the whole int64 range, admit_after=2,
    expire_after_steps=3. The reference is the same table in one process (a LocalRowSource
    split over two shards like the ps), looked up with the same batches at the same points
    and updated with the same rules: sync, the mean of the two workers' rows per step (what
    a sync step applies); async (and max_staleness=1, whose gate releases each push of the
    alternating workers at once), each worker's rows in the order they were pushed. After
    every step the shards' state (ids, rows, slots, counts, last_seen, counters) equals the
    reference's bit for bit, and no two ids share a row. The final checkpoint's documents
    restore the same state, and tfl.load_table_rows reads the rows back. The same with the
    counts toward admission in a small admission filter (its counters compared too)."""
    workers = ("worker:0", "worker:1")
    services = shards(2, workers)
    torch.manual_seed(2)
    models = [Net(admission_filter), None]
    models[1] = copy.deepcopy(models[0])
    reference = _table(admission_filter=admission_filter)
    local = LocalRowSource([reference], num_shards=2)
    updaters = [_updater(services, m, w, mode) for m, w in zip(models, workers, strict=True)]
    try:
        recordings: list[_Recording] = [None, None]  # type: ignore[list-item]

        def start(k: int) -> None:
            recordings[k] = _start(updaters[k], models[k])

        with caplog.at_level(logging.INFO, logger="tensorfleet.ps"):
            _in_threads([lambda k=k: start(k) for k in range(2)])
        ps_stores = [s.service.tables.tables.store("users") for s in services]
        for step in range(STEPS):
            if mode == "sync":
                for k in range(2):  # both look up at the same clock, then one update
                    ids = _batch(step, k)
                    _loss(models[k], ids).backward()
                    with torch.no_grad():
                        reference(ids)
                _in_threads([lambda u=u, s=step: u.exchange(s, None) for u in updaters])
                parts = [recordings[k].pushed[-1] for k in range(2)]
                for shard in range(2):
                    mean = mean_rows([p[shard] for p in parts], 2, DIM, torch.float32)
                    local.shards[shard].apply("users", mean)
            else:
                for k in range(2):  # one worker after the other: a known order
                    ids = _batch(step, k)
                    _loss(models[k], ids).backward()
                    with torch.no_grad():
                        reference(ids)
                    updaters[k].exchange(2 * step + k, None)
                    local.push_rows("users", recordings[k].pushed[-1])
            for shard in range(2):
                _assert_same_state(ps_stores[shard], local.shards[shard].store("users"), step)
                _assert_no_shared_rows(ps_stores[shard])
        before = [s.state() for s in ps_stores]  # an evaluation on the shards changes nothing
        with torch.no_grad():
            models[0](torch.cat([VOCAB, torch.tensor([123456789])]))
        for shard, state in enumerate(before):
            assert all(torch.equal(v, ps_stores[shard].state()[k]) for k, v in state.items())
        totals = {key: sum(s.counters[key] for s in ps_stores) for key in ("admitted", "evicted")}
        assert totals["admitted"] > 6 and totals["evicted"] > 0, totals
        if admission_filter is None:
            assert sum(s.counters["forgotten"] for s in ps_stores) > 0  # the ids seen once
            assert sum(s.stats()["pending"] for s in ps_stores) > 0  # rare ids still counting
        else:  # the map holds only ids with rows; the counts are in the filters
            assert all(s.stats()["pending"] == 0 for s in ps_stores)
            assert all(int(s.filter.counters.sum()) > 0 for s in ps_stores)
        created = [r.getMessage() for r in caplog.records if "created table" in r.getMessage()]
        counted = (
            ""
            if admission_filter is None
            else ", counted in a filter sized for 8 ids at a 0.2 false positive rate"
        )
        assert any(
            f"table 'users' of raw ids (admit after 2 updates{counted}, expire after 3 steps "
            f"unseen): up to 32 of its 64 rows live here" in line
            for line in created
        ), created
        with caplog.at_level(logging.INFO, logger="tensorfleet.ps"):
            saved = updaters[0].save()
        logged = [
            r.getMessage() for r in caplog.records if "saving table 'users'" in r.getMessage()
        ]
        assert len(logged) == 2, logged
        assert all(" rows live (" in line and " evicted), " in line for line in logged), logged
        path = CheckpointDirectory(tmp_path / "checkpoints").write(
            saved.global_step, list(saved.documents), saved.placement, {}
        )
        stats = updaters[0].stats()
        assert [s["tables"]["users"]["rows_live"] for s in stats] == [s.size for s in ps_stores]
        assert [s["tables"]["users"]["evicted"] for s in stats] == [
            s.counters["evicted"] for s in ps_stores
        ]
    finally:
        for updater in updaters:
            updater.close()
    for shard, document in enumerate(saved.documents):
        restored = TableRequests(None, shard, None)
        restored.restore(decode_shard(document).tables)
        _assert_same_state(restored.tables.store("users"), ps_stores[shard], "restored")
    ids, values = tfl.load_table_rows(path, "users")
    held = [s.rows() for s in ps_stores]
    want_ids = torch.cat([i for i, _ in held])
    order = torch.argsort(want_ids)
    assert torch.equal(ids, want_ids[order])
    assert torch.equal(values, torch.cat([v for _, v in held])[order])


# -- one process ---------------------------------------------------------------------------------


def test_a_one_process_session_trains_a_raw_table_checkpoints_and_restores_it(tmp_path) -> None:
    """TrainingSession(None, ...) attaches the raw table to rows in this process, with its
    admission and expiry; the run's checkpoint holds the id map and counts, and a second run
    restores them exactly (the state after 6 + 6 steps equals 12 steps without a stop)."""

    def run(steps: int, directory: str | None, first: int = 0) -> RawIdRowStore:
        torch.manual_seed(5)
        model = Net()
        with tfl.TrainingSession(
            None,
            model,
            optimizer=tfl.optim.SGD(lr=0.1),
            hooks=[tfl.StopAtStep(last_step=steps)],
            checkpoint_dir=directory,
        ) as sess:
            while not sess.should_stop():
                ids = _batch(sess.global_step, 0)
                sess.step(lambda ids=ids: _loss(sess.model, ids))
        return model.users._source.shards[0].store("users")

    whole = run(12, None)
    assert whole.counters["admitted"] > 0 and whole.counters["evicted"] > 0
    directory = str(tmp_path / "run")
    run(6, directory)
    resumed = run(12, directory)
    _assert_same_state(resumed, whole, "resumed")


def test_uint64_ids_get_rows_of_their_own_as_the_int64_of_the_same_bits() -> None:
    """A uint64 id space (e.g. 64-bit fingerprints from numpy) maps one to one onto int64:
    ids above 2**63 - 1 get rows of their own, and a checkpoint's ids read back as uint64
    with ``.view(torch.uint64)``."""
    import numpy as np

    table = EmbeddingTable(16, DIM, name="users", ids="raw", rule=RULE)
    LocalRowSource([table], num_shards=2)
    unsigned = torch.from_numpy(np.array([2**64 - 1, 2**63, 2**63 - 1, 0], dtype=np.uint64))
    assert unsigned.dtype == torch.uint64
    rows = table(unsigned)
    assert rows.shape == (4, DIM)
    assert torch.equal(table(unsigned.view(torch.int64)), rows)  # the same rows
    assert len({tuple(r.tolist()) for r in rows}) == 4  # none shared
    assert table.rows_of(unsigned).view(torch.uint64).tolist() == [2**64 - 1, 2**63, 2**63 - 1, 0]


def test_ids_that_differ_only_in_their_top_bits_start_from_values_of_their_own() -> None:
    """Slot-tagged feature ids (a slot number in the top bits) and ``x`` against
    ``x + 2**63``: a row number's counter ``id * 2 dim + column`` would wrap onto the same
    values; a raw id is mixed over all 64 bits first."""
    initializer = tfl.RowInitializer("normal", 1.0, seed=4)
    base = 12345
    ids = torch.tensor([base, base - 2**63, base + (1 << 57), base + (5 << 58)], dtype=torch.int64)
    rows = initializer.rows(ids, 64, torch.float32, raw_ids=True)
    assert len({tuple(r.tolist()) for r in rows}) == 4
    wrapped = initializer.rows(ids, 64, torch.float32)  # as row numbers: all the same
    assert len({tuple(r.tolist()) for r in wrapped}) == 1
    assert abs(float(rows.std()) - 1.0) < 0.2  # still N(0, 1)


def test_an_evaluation_neither_creates_rows_nor_keeps_them_from_expiring() -> None:
    """Lookups under ``no_grad`` (or in ``eval()``) read only: a row looked up only by an
    evaluation expires as if nobody had looked, an id only evaluated gets no row (it reads
    the values its row would start from, with ``admit_after=0``), and nothing is marked for
    the next delta. The same lookups while training keep the row and create the new one."""
    for evaluated in (True, False):
        table = EmbeddingTable(64, DIM, name="users", ids="raw", expire_after_steps=2, rule=RULE)
        source = LocalRowSource([table], num_shards=1)
        store = source.shards[0].store("users")
        old, new, other = torch.tensor([I64.max]), torch.tensor([I64.min]), torch.tensor([7])
        table(old).sum().backward()
        table.push_gradient()  # old has a row now
        for _ in range(2):
            if evaluated:
                with torch.no_grad():
                    looked = table(torch.cat([old, new]))
                assert torch.equal(
                    looked[1], table.initializer.rows(new, DIM, torch.float32, raw_ids=True)[0]
                )
                table.eval()
                table(torch.cat([old, new]))  # eval() reads only as well, with grad enabled
                table.train()
            else:
                table(torch.cat([old, new])).sum().backward()
                table.push_gradient()
            table(other).sum().backward()
            table.push_gradient()
        rows = store.created_rows().tolist()
        if evaluated:
            assert rows == [7] and store.counters["evicted"] == 1, rows  # old expired
        else:
            assert rows == sorted([I64.min, 7, I64.max]), rows


def test_an_evaluation_marks_nothing_for_the_next_delta() -> None:
    table = EmbeddingTable(64, DIM, name="users", ids="raw", rule=RULE)
    source = LocalRowSource([table], num_shards=1)
    store = source.shards[0].store("users")
    table(torch.tensor([3, 4])).sum().backward()
    table.push_gradient()
    store.encode()  # a checkpoint: a delta since it holds what changed after
    since = store.save_clock
    with torch.no_grad():
        table(torch.tensor([3, 4, 5]))
    assert store.changed_state(since)["keys"].numel() == 0
