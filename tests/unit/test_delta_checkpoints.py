"""Delta checkpoints of the embedding tables (``full_checkpoint_every=K``): a chain of a full
checkpoint and the deltas after it restores exactly the live state (rows, optimizer slots,
and for a table of raw ids the id map, counts and evictions), on two ps shards and in one
process; keep-last-K keeps every base a kept delta needs; a delta whose base is missing or
corrupt is refused naming the file, and the newest complete chain is restored instead; a
delta is smaller than a full checkpoint when few rows changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load as safetensors_load
from torch import nn

import tensorfleet as tfl
from tensorfleet.errors import CheckpointError, ConfigError
from tensorfleet.ps.layout import FusedLayout
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.raw_id_rows import RawIdRowStore
from tensorfleet.ps.row_store import RowStore
from tensorfleet.ps.shard_checkpoint import decode_shard, encode_shard
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.table_deltas import header_metadata, merge, tag_of
from tensorfleet.ps.table_requests import TableRequests
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.session.checkpoints import CheckpointDirectory, read_chain
from tensorfleet.session.delta_checkpoints import DeltaPlan, table_documents
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.worker.embedding_table import EmbeddingTable
from tensorfleet.worker.local_row_source import LocalRowSource
from tensorfleet.worker.ps_updater import PsUpdater
from tensorfleet.worker.timeouts import ClientTimeouts

from .test_raw_id_tables import SECRET, _assert_same_state, _batch, _table, shards  # noqa: F401

pytestmark = pytest.mark.timeout(120)
TIMEOUTS = ClientTimeouts(connect_s=10.0, initialize_s=20.0, step_s=20.0, recover_s=30.0)
HASHED_ROWS, DIM = 500, 4


class TwoTables(nn.Module):
    """A hashed table (row numbers, Adagrad) and a table of raw ids with admission after 2
    updates and expiry after 3 steps unseen (:func:`_table`), and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.users = _table()
        self.items = EmbeddingTable(
            HASHED_ROWS,
            DIM,
            name="items",
            initializer=tfl.RowInitializer("normal", 1.0, seed=7),
            rule=SparseRowRule("adagrad", {"lr": 0.3}),
        )
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        items = ids.remainder(HASHED_ROWS)
        return self.head(torch.cat([self.users(ids), self.items(items)], -1)).squeeze(-1)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(ids), (ids % 3).float())


def _assert_rows_equal(got: RowStore, want: RowStore, context: object) -> None:
    a, b = got.encode(), want.encode()
    got_tensors = {k: v for k, v in _tensors(a).items()}
    for key, tensor in _tensors(b).items():
        assert torch.equal(got_tensors[key], tensor), (context, key)
    assert got.step == want.step, context


def _tensors(document: bytes) -> dict[str, torch.Tensor]:
    return dict(safetensors_load(document))


# -- the documents alone ------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [False, True], ids=["hashed", "raw_ids"])
def test_a_chain_of_deltas_folds_into_the_full_document_byte_for_byte(raw: bool) -> None:
    """After every checkpoint of a chain (each delta since the one before), folding the
    deltas onto the full document gives byte for byte the document the store writes in
    full now: rows, slots, and (raw ids) the map with counts and last_seen, with the ids
    evicted in between gone."""
    model = TwoTables()
    table = model.users if raw else model.items
    source = LocalRowSource([model.users, model.items], num_shards=2)
    documents = source.save()
    chain = [dict(d) for d in documents]
    tags = [{n: _tag(d) for n, d in shard.items()} for shard in documents]
    for step in range(15):
        _loss(model, _batch(step, 0)).backward()
        model.users.push_gradient()
        model.items.push_gradient()
        if step % 3 == 2:
            deltas = source.save(tags)
            for k in range(2):
                name = table.spec().name
                assert header_metadata(deltas[k][name])[1], "a delta was asked for"
                chain[k][name] = merge(chain[k][name], deltas[k][name], f"shard {k}")
                _assert_same_document(chain[k][name], source.shards[k].store(name).encode(), step)
            tags = [{n: _tag(d) for n, d in shard.items()} for shard in deltas]
    if raw:  # ids were evicted during the chain (it starts with the empty table)
        assert sum(s.store("users").counters["evicted"] for s in source.shards) > 0


def _tag(document: bytes) -> list[int]:
    tag = tag_of(header_metadata(document)[0])
    assert tag is not None
    return tag


def _assert_same_document(got: bytes, want: bytes, context: object) -> None:
    """The same tensors, byte for byte, and the same metadata but for the tag (the live
    store's ``encode`` is one document later than the delta)."""
    (got_meta, got_delta), (want_meta, _) = header_metadata(got), header_metadata(want)
    assert not got_delta
    got_meta.pop("tag"), want_meta.pop("tag")
    assert got_meta == want_meta, context
    a, b = _tensors(got), _tensors(want)
    assert a.keys() == b.keys(), context
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (context, key)


@pytest.mark.parametrize("raw", [False, True], ids=["hashed", "raw_ids"])
def test_a_delta_the_chief_failed_to_write_costs_nothing(raw: bool) -> None:
    """A delta taken but never written (the chief's disk failed): the next one, asked since
    the last checkpoint written, still holds every change since it, the lost delta's too."""
    model = TwoTables()
    name = "users" if raw else "items"
    source = LocalRowSource([model.users, model.items], num_shards=1)
    full = source.save()[0][name]
    for step in range(8):
        _loss(model, _batch(step, 0)).backward()
        model.users.push_gradient()
        model.items.push_gradient()
        if step == 3:
            source.save([{name: _tag(full)}])  # taken, then lost
    delta = source.save([{name: _tag(full)}])[0][name]
    live = source.shards[0].store(name).encode()
    _assert_same_document(merge(full, delta, "the chain"), live, "since the last written")


def test_a_delta_of_another_incarnation_or_base_is_refused_and_a_stale_tag_saves_in_full() -> None:
    model, other_model = TwoTables(), TwoTables()
    source = LocalRowSource([model.items], num_shards=1)
    full = source.save()[0]["items"]
    model.items(torch.arange(10)).sum().backward()
    model.items.push_gradient()
    delta = source.save([{"items": _tag(full)}])[0]["items"]
    assert header_metadata(delta)[1]
    # another store (a restarted ps) does not know the tag: it answers in full
    assert not header_metadata(source.save([{"items": [12345, 0]}])[0]["items"])[1]
    other = LocalRowSource([other_model.items], num_shards=1).save()[0]["items"]
    with pytest.raises(CheckpointError, match="is not the checkpoint this delta was made against"):
        merge(other, delta, "checkpoint X")
    with pytest.raises(ConfigError, match="full_checkpoint_every must be an int >= 1"):
        DeltaPlan(0)


# -- two ps shards ------------------------------------------------------------------------------


def _updater(services: list, model: nn.Module) -> PsUpdater:
    specs = [
        VariableSpec(n, tuple(p.shape), dtype_name(p.dtype), p.element_size())
        for n, p in model.named_parameters()
    ]
    updater = PsUpdater(
        [s.address for s in services],
        SECRET,
        "worker:0",
        is_chief=True,
        plan=plan_placement(specs, len(services)),
        discipline=UpdateDiscipline(mode="async"),
        timeouts=TIMEOUTS,
    )
    updater.connect()
    updater.wrap(model)
    updater.register(list(model.named_parameters()), UpdateRule("sgd", {"lr": 0.1}))
    updater.restore(None)
    updater.pull()
    return updater


def test_two_shards_with_delta_checkpoints_restore_the_live_state_bit_for_bit(
    shards,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A raw-id table (admission, expiry) and a hashed Adagrad table on two ps shards,
    checkpointed every 3 steps with full_checkpoint_every=4 (full, delta, delta, delta,
    full, ...) and keep=3. After every checkpoint the newest chain, read back and restored
    into fresh shards, equals the live shards bit for bit: rows, slots, and the raw table's
    id map, counts, last_seen and counters (evicted ids stay evicted). Keep-last-3 never
    removed a base a kept delta needs, and tfl.load_table_rows reads the chain."""
    services = shards(2, ("worker:0",))
    torch.manual_seed(2)
    model = TwoTables()
    directory = CheckpointDirectory(tmp_path / "checkpoints", keep=3)
    plan = DeltaPlan(4)
    updater = _updater(services, model)
    kinds = []
    try:
        live = [s.service.tables.tables for s in services]
        for step in range(30):
            _loss(model, _batch(step, 0)).backward()
            updater.exchange(step, None)
            if step % 3 != 2:
                continue
            saved = updater.save(tables_since=plan.since())
            fields = plan.manifest_fields(saved.documents, saved.global_step)
            assert fields is not None
            path = directory.write(
                saved.global_step, list(saved.documents), saved.placement, fields
            )
            plan.written(path, saved.documents, saved.global_step)
            kinds.append(fields["kind"])
            checkpoint = directory.newest_valid()
            assert checkpoint is not None and checkpoint.path == path
            for shard, document in enumerate(checkpoint.documents):
                restored = TableRequests(None, shard, None)
                restored.restore(decode_shard(document).tables)
                users = restored.tables.store("users")
                assert isinstance(users, RawIdRowStore)
                _assert_same_state(users, live[shard].store("users"), (step, shard))
                _assert_rows_equal(restored.tables.store("items"), live[shard].store("items"), step)
            ids, values = tfl.load_table_rows(path, "users")
            held = [s.store("users").rows() for s in live]
            order = torch.argsort(torch.cat([i for i, _ in held]))
            assert torch.equal(ids, torch.cat([i for i, _ in held])[order])
            assert torch.equal(values, torch.cat([v for _, v in held])[order])
            _assert_bases_kept(directory)
        evicted = sum(s.store("users").counters["evicted"] for s in live)
        assert evicted > 0
    finally:
        updater.close()
    assert kinds == ["full", "delta", "delta", "delta"] * 2 + ["full", "delta"], kinds


def _assert_bases_kept(directory: CheckpointDirectory) -> None:
    """Every checkpoint left is readable whole (its chain complete), at most ``keep`` are
    not needed as a base, and no base was removed."""
    found = directory.step_directories()
    needed = set()
    for _, path in found:
        read_chain(path)  # raises if a base is missing
        manifest = json.loads((path / "manifest.json").read_text())
        if manifest.get("base"):
            needed.add(manifest["base"])
    assert len([p for _, p in found if p.name not in needed]) <= directory.keep


# -- one process: the session ------------------------------------------------------------------


class RawNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = _table()
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.users(ids)).squeeze(-1)


def _run(steps: int, directory: str | None, **options: object) -> RawIdRowStore:
    torch.manual_seed(5)
    model = RawNet()
    with tfl.TrainingSession(
        None,
        model,
        optimizer=tfl.optim.SGD(lr=0.1),
        hooks=[tfl.StopAtStep(last_step=steps)],
        checkpoint_dir=directory,
        **options,
    ) as sess:
        while not sess.should_stop():
            ids = _batch(sess.global_step, 0)
            sess.step(lambda ids=ids: _loss(sess.model, ids))
    return model.users._source.shards[0].store("users")


def _kinds(root: Path) -> dict[int, tuple[str, str | None]]:
    found = {}
    for path in sorted(root.glob("step-*")):
        manifest = json.loads((path / "manifest.json").read_text())
        found[manifest["global_step"]] = (manifest["kind"], manifest.get("base"))
    return found


def test_a_session_writes_deltas_keeps_their_bases_and_resumes_from_the_chain(
    tmp_path: Path,
) -> None:
    """TrainingSession(full_checkpoint_every=3, keep_checkpoints=2), a checkpoint every
    step: full, delta, delta, full, ...; the two newest are kept with the bases they need.
    A second run restores the newest chain (a delta) and ends equal, bit for bit, to a run
    of 12 steps without a stop."""
    whole = _run(12, None)
    directory = tmp_path / "run"
    options = {"save_checkpoint_steps": 1, "keep_checkpoints": 2, "full_checkpoint_every": 3}
    _run(5, str(directory), **options)
    kinds = _kinds(directory)
    # steps 1..5 and the final save at 5: F1 d2 d3 F4 d5 -> kept d5, F4 (the base)
    assert kinds == {4: ("full", None), 5: ("delta", "step-00000004")}, kinds
    _run(7, str(directory), **options)  # restores d5 (F4 + d5); then F6? no: full after restore
    kinds = _kinds(directory)
    assert kinds[6] == ("full", None), kinds
    assert kinds[7] == ("delta", "step-00000006"), kinds
    resumed = _run(12, str(directory), **options)
    _assert_same_state(resumed, whole, "resumed from a chain")


def test_a_delta_whose_base_is_missing_or_corrupt_is_refused_and_the_newest_chain_restored(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    directory = tmp_path / "run"
    options = {"save_checkpoint_steps": 1, "keep_checkpoints": 10, "full_checkpoint_every": 2}
    _run(4, str(directory), **options)  # F1 d2 F3 d4
    assert _kinds(directory) == {
        1: ("full", None),
        2: ("delta", "step-00000001"),
        3: ("full", None),
        4: ("delta", "step-00000003"),
    }
    shard = directory / "step-00000003" / "shard-0-of-1.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="needs .*step-00000003.*which is unusable.*corrupt"):
        read_chain(directory / "step-00000004")
    checkpoint = CheckpointDirectory(directory).newest_valid()
    assert checkpoint is not None and checkpoint.global_step == 2  # F1 + d2
    shutil.rmtree(directory / "step-00000001")
    with pytest.raises(CheckpointError, match=r"step-00000001/manifest.json, which is missing"):
        read_chain(directory / "step-00000002")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        tfl.load_table_rows(directory, "users")


def test_a_delta_is_smaller_than_a_full_checkpoint_when_few_rows_changed(tmp_path: Path) -> None:
    """A 20,000-row table with every row created, then 1% of its rows updated: the delta
    checkpoint's files hold under a tenth of the full one's bytes (as its manifest and the
    files on disk say)."""
    table = EmbeddingTable(
        20_000,
        8,
        name="big",
        rule=SparseRowRule("adagrad", {"lr": 0.1}),
        initializer=tfl.RowInitializer("normal", 0.1),
    )
    source = LocalRowSource([table], num_shards=2)
    with torch.no_grad():
        table(torch.arange(20_000))  # every row created
    directory = CheckpointDirectory(tmp_path, keep=5)
    plan = DeltaPlan(10)
    sizes = []
    for step in range(2):
        documents = [_shard_document(d) for d in source.save(plan.since(step))]
        fields = plan.manifest_fields(documents, step)
        assert fields is not None
        path = directory.write(step, documents, {}, fields)
        plan.written(path, documents, step)
        sizes.append(sum(f.stat().st_size for f in path.glob("*.safetensors")))
        touched = torch.randperm(20_000, generator=torch.Generator().manual_seed(1))[:200]
        table(touched).sum().backward()
        table.push_gradient()
    full, delta = sizes
    assert _kinds(tmp_path)[1][0] == "delta"
    assert delta * 10 < full, (full, delta)
    assert len(table_documents(path.joinpath("shard-0-of-2.safetensors").read_bytes())) == 1


def _shard_document(tables: dict[str, bytes]) -> bytes:
    return bytes(
        encode_shard(
            shard=0,
            global_step=0,
            version=0,
            rule={"name": "sgd"},
            layout=FusedLayout.of([]),
            values={},
            ema=None,
            optimizer={},
            worker_data={},
            tables=tables,
        )
    )
