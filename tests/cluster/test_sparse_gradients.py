"""``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` train in every ps mode
(async, sync, bounded staleness) across processes, their weights held by the ps as rows and
pushed as rows: the loss falls, every worker's copy of each weight equals the shards' rows
bit for bit, and the final checkpoint loads strictly into a fresh model (the weights
reassembled whole from the shards' rows)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tensorfleet as tfl
from tensorfleet.ps.row_store import RowStore
from tensorfleet.ps.shard_checkpoint import decode_shard
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.worker.local_row_source import LocalRowSource
from tensorfleet.worker.sparse_gradient import densify_sparse_gradients

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
STEPS = 40


@pytest.mark.parametrize(
    ("mode", "extra"),
    [
        ("async", []),
        ("sync", []),
        ("async", ["--max-staleness", "1"]),
        ("sync", ["--optimizer", "sparse_adam"]),
        ("async", ["--optimizer", "adagrad"]),
        ("async", ["--table"]),
        ("async", ["--table", "--max-staleness", "0"]),  # rows held by the gate
    ],
)
def test_sparse_embeddings_converge_across_processes(tmp_path, mode, extra):
    """``--table``: the first lookup is a ``tfl.EmbeddingTable`` on the ps shards; the
    final checkpoint then holds each shard's rows and the partition plan in its manifest.
    Without it both lookups are sparse ``nn.Embedding``/``nn.EmbeddingBag`` weights held as
    rows: each worker's copy equals the shards' rows (in sync training also the final
    checkpoint's, bit for bit), and the checkpoint loads strictly into a fresh model."""
    out = tmp_path / "result.json"
    extra = [*extra, "--checkpoint-dir", str(tmp_path / "checkpoints")]
    command = [
        sys.executable, str(PROGRAMS / "sparse_embedding_worker.py"), str(out), mode, str(STEPS),
        *extra,
    ]  # fmt: skip
    run = run_local_cluster(2, 2, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    assert result["global_step"] >= STEPS, str(run)  # async workers may finish one step past
    assert result["after"] < 0.5 * result["before"], f"{result}\n{run}"
    if "--table" in extra:
        (newest,) = sorted((tmp_path / "checkpoints").glob("step-*"))[-1:]
        manifest = json.loads((newest / "manifest.json").read_text())
        assert manifest["placement"]["table/embedding"]["shards"] == 2, manifest
        for shard in range(2):
            document = (newest / f"shard-{shard}-of-2.safetensors").read_bytes()
            # the EmbeddingTable, and the sparse nn.EmbeddingBag's weight held as rows
            assert set(decode_shard(document).tables) == {"embedding", "bag.weight"}, str(run)
        ids, values = tfl.load_table_rows(newest, "embedding")  # both shards' created rows
        assert set(ids.remainder(2).tolist()) == {0, 1} and values.shape == (ids.numel(), 4)
    else:
        _check_mirrored_weights(tmp_path, out, mode, run)


def _check_mirrored_weights(tmp_path, out, mode: str, run) -> None:
    program = _program()
    (newest,) = sorted((tmp_path / "checkpoints").glob("step-*"))[-1:]
    manifest = json.loads((newest / "manifest.json").read_text())
    for name in ("embedding.weight", "bag.weight"):
        assert manifest["placement"][f"table/{name}"]["param"] == name, manifest["placement"]
        assert name not in manifest["placement"]  # not a dense variable
        for shard in range(2):
            document = decode_shard((newest / f"shard-{shard}-of-2.safetensors").read_bytes())
            assert name in document.tables and f"value/{name}" not in document.values
    state = tfl.load_checkpoint(newest, program.Net())  # strict: every parameter, whole
    for name in ("embedding.weight", "bag.weight"):  # the same rows, read as a table's
        ids, values = tfl.load_table_rows(newest, name)
        assert torch.equal(ids, torch.arange(program.IDS)) and torch.equal(values, state[name])
    for index in range(2):
        mine = json.loads(Path(f"{out}.{index}.json").read_text())
        assert mine["matches_ps"], f"worker:{index}'s copy differs from the ps rows\n{run}"
        if mode == "sync":  # nothing changes after the last step: the checkpoint's rows
            for name, weight in mine["weights"].items():
                assert torch.equal(torch.tensor(weight), state[name]), (index, name)


def _program():
    spec = importlib.util.spec_from_file_location(
        "program", PROGRAMS / "sparse_embedding_worker.py"
    )
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    return program


def _one_process_sync_reference(steps: int, workers: int) -> tuple[torch.Tensor, list]:
    """What sync training of ``sparse_embedding_worker.py --table-only`` must give: each
    step's gradient is the mean of the workers' (equal slices, mean losses), the gradient of
    one process on their whole batch; the table's rows take the same SGD as the head."""
    program = _program()
    torch.manual_seed(3)
    model = program.TableOnly()
    model.embedding.table_name = "embedding"
    LocalRowSource([model.embedding], num_shards=1, rule=SparseRowRule("sgd", {"lr": 2.0}))
    optimizer = torch.optim.SGD(model.out.parameters(), lr=2.0)
    ids, labels = program.make_data((steps + 16) * workers * program.BATCH)
    size = workers * program.BATCH
    for step in range(steps):
        xb, yb = ids[step * size : (step + 1) * size], labels[step * size : (step + 1) * size]
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        model.embedding.push_gradient()
        optimizer.step()
    with torch.no_grad():
        return model.embedding(torch.arange(program.IDS)), list(model.out.parameters())


@pytest.mark.parametrize(("mode", "prefetch"), [("async", False), ("sync", False), ("sync", True)])
def test_a_shard_holding_only_table_rows(tmp_path, mode, prefetch):
    """3 ps and a model of one table and a linear head (weight and bias: 2 dense variables):
    one shard holds no dense variable, only its third of the table's rows. It trains, and
    the final checkpoint holds that shard's document (no variables, the table's rows).

    In sync mode the table's rows are averaged by the sync step (held per step, the mean over
    the union of the workers' rows): the trained table and head equal one process training
    on the whole batch of each step. With ``prefetch`` each step's lookup was sent ahead
    with the step before's exchange (``EmbeddingTable.prefetch``) and used: the same."""
    out, checkpoints = tmp_path / "result.json", tmp_path / "checkpoints"
    command = [
        sys.executable, str(PROGRAMS / "sparse_embedding_worker.py"), str(out), mode, str(STEPS),
        "--table-only", "--checkpoint-dir", str(checkpoints), *(["--prefetch"] if prefetch else []),
    ]  # fmt: skip
    run = run_local_cluster(3, 2, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    assert result["global_step"] >= STEPS, str(run)
    assert result["after"] < 0.5 * result["before"], f"{result}\n{run}"
    (newest,) = sorted(checkpoints.glob("step-*"))[-1:]
    documents = [
        decode_shard((newest / f"shard-{k}-of-3.safetensors").read_bytes()) for k in range(3)
    ]
    empty = [k for k, d in enumerate(documents) if not d.values]
    assert len(empty) == 1, [sorted(d.values) for d in documents]
    (shard,) = empty
    rows = RowStore.decode(documents[shard].tables["embedding"])
    assert rows.size > 0, str(run)  # it served and updated its rows
    assert set(rows.created_rows().tolist()) <= set(range(shard, 40, 3))
    if prefetch:  # every step's lookup but the first came ahead; the last prefetch missed
        assert result["lookups_ahead"]["used"] == result["global_step"] - 1, str(run)
    if mode == "sync":
        table, head = _one_process_sync_reference(result["global_step"], workers=2)
        got = torch.tensor(result["table"])
        assert torch.allclose(got, table, atol=1e-5), (got - table).abs().max()
        for got_param, want in zip(result["out"], head, strict=True):
            assert torch.allclose(torch.tensor(got_param), want.detach(), atol=1e-5)


def _one_process_session(steps: int) -> tuple[torch.Tensor, list]:
    """``sparse_embedding_worker.py --table-only`` with no cluster: the same model, data and
    optimizer in a one-process ``TrainingSession`` (server=None), which trains the table
    itself (rows in this process, the optimizer's row-sparse twin, pushed every step)."""
    program = _program()
    torch.manual_seed(3)
    model = program.TableOnly()
    ids, labels = program.make_data((steps + 16) * program.BATCH)
    with tfl.TrainingSession(
        None, model, optimizer=tfl.optim.SGD(lr=2.0), hooks=[tfl.StopAtStep(last_step=steps)]
    ) as sess:
        while not sess.should_stop():
            start = sess.global_step * program.BATCH
            xb, yb = ids[start : start + program.BATCH], labels[start : start + program.BATCH]
            sess.step(lambda xb=xb, yb=yb: F.cross_entropy(sess.model(xb), yb))
    with torch.no_grad():
        return model.embedding(torch.arange(program.IDS)), list(model.out.parameters())


def test_one_process_trains_a_table_like_one_ps_and_one_worker(tmp_path):
    """The same script in one process and on 1 ps + 1 worker (async): the same table rows
    and head (the ps applies the same row-sparse SGD to the same gradients)."""
    out = tmp_path / "result.json"
    command = [
        sys.executable, str(PROGRAMS / "sparse_embedding_worker.py"), str(out), "async",
        str(STEPS), "--table-only",
    ]  # fmt: skip
    run = run_local_cluster(1, 1, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    _assert_trained_as_one_process(json.loads(out.read_text()), run)


def _assert_trained_as_one_process(result: dict, run: object) -> None:
    """The chief's ``--table-only`` result (one worker, async) holds the table and head of
    :func:`_one_process_session` over the same steps."""
    assert result["global_step"] == STEPS, str(run)
    table, head = _one_process_session(STEPS)
    got = torch.tensor(result["table"])
    assert torch.allclose(got, table, atol=1e-6), (got - table).abs().max()
    for got_param, want in zip(result["out"], head, strict=True):
        assert torch.allclose(torch.tensor(got_param), want.detach(), atol=1e-6)


@pytest.mark.parametrize("workers", [1, 2])
def test_rows_created_ahead_on_the_shards_train_as_lazy_rows(tmp_path, workers):
    """``EmbeddingTable.create_all_rows()`` in a cluster (2 ps): every worker calls it as the
    session starts; each row is created once, by whichever call reached its shard first (the
    counts the calls return add up to the table's rows), every shard says so in its log, and
    with one worker the trained table and head are the ones of one process with lazy rows
    (the rows are created with the values a first lookup gives them)."""
    out = tmp_path / "result.json"
    command = [
        sys.executable, str(PROGRAMS / "sparse_embedding_worker.py"), str(out), "async",
        str(STEPS), "--table-only", "--rows-ahead",
    ]  # fmt: skip
    run = run_local_cluster(2, workers, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    program = _program()
    created = [int((tmp_path / f"result.json.created.{k}").read_text()) for k in range(workers)]
    assert sum(created) == program.IDS, f"{created}\n{run}"
    for shard in range(2):
        assert f"ps:{shard}: table 'embedding': all 20 of its rows on this shard created" in str(
            run
        ), str(run)
    if workers == 1:
        _assert_trained_as_one_process(json.loads(out.read_text()), run)


def test_a_table_model_trains_with_prefetch(tmp_path):
    """``Overlap(prefetch=True)`` applies to a model with an embedding table (async): a
    step leaves its row pushes in flight with its dense replies, and they are awaited at the
    next step's exchange and before ``cluster_stats()`` and the session's end, so every row
    push of every step was applied on every shard (each counts a step per push, empty parts
    too) and none dropped; the model trains, and no warning says prefetch is off."""
    out = tmp_path / "result.json"
    command = [
        sys.executable, str(PROGRAMS / "sparse_embedding_worker.py"), str(out), "async",
        str(STEPS), "--table-only", "--overlap-prefetch", "--prefetch",
    ]  # fmt: skip
    run = run_local_cluster(2, 1, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    assert "is off for this model" not in str(run), str(run)
    assert result["after"] < 0.5 * result["before"], f"{result}\n{run}"
    steps = result["global_step"]
    assert steps >= STEPS, str(run)
    assert result["table_steps"] == [steps, steps], f"{result}\n{run}"
    assert result["dropped_row_pushes"] == 0, str(run)


def test_a_sparse_gradient_becomes_the_dense_gradient_with_duplicates_summed():
    embedding = torch.nn.Embedding(6, 3, sparse=True)
    embedding(torch.tensor([1, 4, 1])).sum().backward()
    sparse = embedding.weight.grad
    expected = sparse.to_dense()
    assert densify_sparse_gradients([("w", embedding.weight)]) == ["w"]
    assert not embedding.weight.grad.is_sparse
    assert torch.equal(embedding.weight.grad, expected)
    assert torch.equal(embedding.weight.grad[1], torch.full((3,), 2.0))
    assert densify_sparse_gradients([("w", embedding.weight)]) == []  # dense: left alone
