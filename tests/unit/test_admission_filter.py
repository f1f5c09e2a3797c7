"""The admission filter of a table of raw ids (``ps/admission_filter.py``): sized as the
module says; with room to spare it admits exactly as exact counting does, bit for bit; when
small it admits no id later than its N-th update, in memory that does not grow with the
ids seen; an expired id keeps its count; its counters are part of a checkpoint and of every
delta (only those changed since the document written last when they are few), and a chain
of deltas folds back into the full document byte for byte; the arguments are checked."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

import tensorfleet as tfl
from tensorfleet.errors import CheckpointError, ConfigError
from tensorfleet.ps.admission_filter import CountingFilter
from tensorfleet.ps.raw_id_rows import RawIdRowStore, decode_store
from tensorfleet.ps.row_partition import HASH, RowPartition, TableSpec
from tensorfleet.ps.sparse_rows import SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.table_deltas import DELTA_KEY, encode_delta, merge

DIM, CAPACITY = 3, 4096
RULE = SparseRowRule("adagrad", {"lr": 0.1})
I64 = torch.iinfo(torch.int64)


def _store(
    admit_after: int = 3,
    admission_filter: tfl.AdmissionFilter | None = None,
    expire: int | None = None,
    capacity: int = CAPACITY,
) -> RawIdRowStore:
    table = TableSpec(
        "users",
        capacity,
        DIM,
        raw_ids=True,
        admit_after=admit_after,
        expire_after_steps=expire,
        admission_filter=admission_filter,
    )
    return RawIdRowStore(table, RowPartition(capacity, 1, HASH), 0, RULE)


def _updates(steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Unique ids per update over the whole int64 range: a few frequent, many seen once."""
    generator = torch.Generator().manual_seed(seed)
    frequent = torch.randint(I64.min, I64.max, (40,), generator=generator)
    batches = []
    for _ in range(steps):
        some = frequent[torch.randint(0, 40, (12,), generator=generator)]
        once = torch.randint(I64.min, I64.max, (20,), generator=generator)
        batches.append(torch.unique(torch.cat([some, once])))
    return batches


def _step(store: RawIdRowStore, ids: torch.Tensor) -> None:
    store.pull(ids)
    store.apply(SparseRows(ids, torch.full((ids.numel(), DIM), 0.5)))


def test_the_filter_is_sized_as_documented() -> None:
    m, k = tfl.AdmissionFilter(1_000_000, 0.01).shape(1)
    assert m == math.ceil(-1_000_000 * math.log(0.01) / math.log(2) ** 2) and k == 7
    assert 9.5 < m / 1_000_000 < 9.7  # about 9.6 one-byte counters per id
    m2, k2 = tfl.AdmissionFilter(1_000_000, 0.01).shape(2)  # each of 2 shards: half the ids
    assert m2 == math.ceil(-500_000 * math.log(0.01) / math.log(2) ** 2) and k2 == 7


def test_with_room_to_spare_it_admits_exactly_as_exact_counts_do() -> None:
    exact = _store()
    filtered = _store(admission_filter=tfl.AdmissionFilter(1_000_000, 1e-6))
    for ids in _updates(30):
        _step(exact, ids)
        _step(filtered, ids)
        a, b = exact.state(), filtered.state()
        for key in ("ids", "values", "slot/sum"):
            assert torch.equal(a[key], b[key]), key
        assert exact.counters == filtered.counters
    assert exact.counters["admitted"] > 10
    # the exact map also holds every id still counting; the filtered map only ids with rows
    assert exact.stats()["pending"] > 100 and filtered.stats()["pending"] == 0


def test_a_small_filter_admits_no_id_later_and_its_memory_does_not_grow() -> None:
    small = _store(admission_filter=tfl.AdmissionFilter(50, 0.1), capacity=1 << 20)
    exact = _store(capacity=1 << 20)
    filter_bytes = small.filter.nbytes
    for ids in _updates(60, seed=1):
        _step(small, ids)
        _step(exact, ids)
        assert small._keys.numel() == small.size  # the map: ids with rows, no tail
        assert small.filter.nbytes == filter_bytes
        assert bool(torch.isin(exact.created_rows(), small.created_rows()).all())  # never late
    assert small.size > exact.size  # and some early (the filter is far too small)
    assert exact.stats()["pending"] > 1000 and small.stats()["pending"] == 0
    assert exact.stats()["admission_bytes"] == exact.stats()["pending"] * 32
    assert small.stats()["admission_bytes"] == filter_bytes


def test_an_expired_id_keeps_its_count_and_returns_at_its_next_update() -> None:
    store = _store(admit_after=2, admission_filter=tfl.AdmissionFilter(1000), expire=2)
    returning, other = torch.tensor([I64.max]), torch.tensor([7])
    _step(store, returning)
    _step(store, returning)  # its second update: admitted
    assert store.counters["admitted"] == 1
    _step(store, other)
    _step(store, other)  # returning unseen for 2 updates: evicted
    assert store.counters["evicted"] == 1 and not bool(torch.isin(returning, store.created_rows()))
    _step(store, returning)  # its count is still 2 in the filter: a row at once
    assert bool(torch.isin(returning, store.created_rows()))


def test_the_counters_are_in_checkpoints_and_deltas_and_a_chain_folds_back_exactly() -> None:
    store = _store(admission_filter=tfl.AdmissionFilter(500, 0.05), expire=5)
    batches = _updates(24, seed=2)
    for ids in batches[:8]:
        _step(store, ids)
    document = store.encode()
    restored = decode_store(document, expect=store.table)
    assert torch.equal(restored.filter.counters, store.filter.counters)
    for start in (8, 16):
        tag = store.metadata()["tag"]
        for ids in batches[start : start + 8]:
            _step(store, ids)
        document = merge(document, encode_delta(store, tag[1]), "a test's chain")
        assert document == store.encode()  # byte for byte the full document
    chained = decode_store(document, expect=store.table)
    for key, value in store.state().items():
        assert torch.equal(chained.state()[key], value), key
    # the next updates go on the same way from the restored store
    for ids in _updates(5, seed=3):
        _step(store, ids)
        _step(chained, ids)
    assert torch.equal(chained.filter.counters, store.filter.counters)
    assert torch.equal(chained.state()["values"], store.state()["values"])


def test_a_document_whose_counters_do_not_fit_is_refused() -> None:
    store = _store(admission_filter=tfl.AdmissionFilter(500, 0.05))
    _step(store, torch.tensor([1, 2, 3]))
    tensors = {k: v.contiguous() for k, v in store.state().items() if k != "step"}
    tensors["admission_filter"] = tensors["admission_filter"][:-1].contiguous()
    with pytest.raises(CheckpointError, match=r"admission_filter is torch.uint8 \[\d+\], expected"):
        RawIdRowStore.decode_checked(tensors, store.metadata(), store.table)


def test_counts_saturate_at_255() -> None:
    counters = CountingFilter(torch.full((8,), 254, dtype=torch.uint8), 2)
    assert counters.count(torch.tensor([1, 2, 3]), up_to=255).tolist() == [255, 255, 255]
    assert int(counters.counters.max()) == 255


def test_the_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="expected_ids must be an int >= 1"):
        tfl.AdmissionFilter(0)
    with pytest.raises(ConfigError, match="false_positive_rate must be a number in"):
        tfl.AdmissionFilter(10, 1.5)
    with pytest.raises(ConfigError, match="admit_after 1..255; got ids='raw', admit_after=0"):
        _store(admit_after=0, admission_filter=tfl.AdmissionFilter(10))
    with pytest.raises(ConfigError, match="admit_after=256"):
        _store(admit_after=256, admission_filter=tfl.AdmissionFilter(10))
    with pytest.raises(ConfigError, match="got ids='rows'"):
        TableSpec("t", 10, 2, admission_filter=tfl.AdmissionFilter(10))
    with pytest.raises(ConfigError, match="must be a tfl.AdmissionFilter or None, got dict"):
        TableSpec("t", 10, 2, raw_ids=True, admit_after=2, admission_filter={"a": 1})  # type: ignore[arg-type]
    spec = TableSpec(
        "t", 10, 2, raw_ids=True, admit_after=2, admission_filter=tfl.AdmissionFilter(99)
    )
    assert TableSpec.from_wire(spec.to_wire()) == spec
    assert "admission_filter" not in str(TableSpec("t", 10, 2, raw_ids=True).to_wire())


def test_a_delta_holds_only_the_counters_changed_since_the_document_written_last() -> None:
    store = _store(admission_filter=tfl.AdmissionFilter(1_000_000, 0.01), capacity=1 << 16)
    batches = _updates(12, seed=4)
    for ids in batches[:4]:
        _step(store, ids)
    document = store.encode()
    first = store.metadata()["tag"]
    for ids in batches[4:8]:
        _step(store, ids)
    delta = encode_delta(store, first[1])
    held = safetensors_load(delta)
    assert "admission_filter" not in held and held["admission_filter_at"].numel() > 0
    assert len(delta) < store.filter.nbytes // 10  # not the filter's 9.6 MB
    document = merge(document, delta, "a test's chain")
    assert document == store.encode()  # byte for byte the full document
    # a delta since an older document (the chief failed to write the one above) is whole
    second = store.metadata()["tag"]
    for ids in batches[8:]:
        _step(store, ids)
    assert "admission_filter" in safetensors_load(encode_delta(store, first[1]))
    # and past an eighth of the counters changed, the whole filter too
    small = _store(admission_filter=tfl.AdmissionFilter(100, 0.05))
    small.encode()
    since = small.metadata()["tag"][1]
    for ids in batches:
        _step(small, ids)
    assert "admission_filter" in safetensors_load(encode_delta(small, since))
    assert second != first


def test_a_delta_whose_filter_changes_do_not_fit_is_refused() -> None:
    store = _store(admission_filter=tfl.AdmissionFilter(100_000, 0.01))
    _step(store, torch.tensor([1, 2, 3]))
    base = store.encode()
    since = store.metadata()["tag"][1]
    _step(store, torch.tensor([4, 5]))
    delta = encode_delta(store, since)
    tensors = safetensors_load(delta)
    tensors["admission_filter_at"] = tensors["admission_filter_at"] + store.filter.nbytes
    metadata = {DELTA_KEY: header_of(delta)}
    with pytest.raises(CheckpointError, match="admission filter changes .* do not fit"):
        merge(base, safetensors_save(tensors, metadata), "a test's chain")


def header_of(document: bytes) -> str:
    """A delta document's own metadata entry, as written."""
    length = int.from_bytes(document[:8], "little")
    return json.loads(document[8 : 8 + length])["__metadata__"][DELTA_KEY]
