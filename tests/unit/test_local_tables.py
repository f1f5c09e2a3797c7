"""``tfl.EmbeddingTable`` in a one-process ``TrainingSession`` (server=None): the session
attaches the tables to rows in this process, with the rule a cluster would use, pushes their
row gradients every step, checkpoints and restores their rows; ``tfl.load_table_rows`` reads
them back. Also the table's own errors (partition, rule) and lookups without a backward."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.errors import CheckpointError, ConfigError
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.sparse_update_rules import SparseRowRule, SparseRuleError
from tensorfleet.worker.embedding_table import EmbeddingTable, TableNotAttached
from tensorfleet.worker.local_row_source import LocalRowSource
from tensorfleet.worker.placement_report import placement_report
from tensorfleet.worker.table_attachment import TableAttachment, find_tables

pytestmark = pytest.mark.timeout(120)

IDS, DIM, CLASSES, BATCH = 40, 4, 3, 16


class Model(nn.Module):
    """A table (no name: the session names it ``embedding``) and a linear head."""

    def __init__(self, rule: SparseRowRule | None = None) -> None:
        super().__init__()
        self.embedding = tfl.EmbeddingTable(
            IDS, DIM, initializer=tfl.RowInitializer("normal", 1.0), rule=rule
        )
        self.out = nn.Linear(DIM, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embedding(ids))


def _data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, IDS, (steps * BATCH,), generator=torch.Generator().manual_seed(5))
    return ids, ids % CLASSES


def _all_rows(table: EmbeddingTable) -> torch.Tensor:
    with torch.no_grad():
        return table(torch.arange(IDS)).clone()


def _session_run(
    steps: int, optimizer=None, checkpoint_dir=None, rule=None, first_step=0, sparse_optimizer=None
):
    """Train ``Model`` in one process; returns the model and the session."""
    torch.manual_seed(3)
    model = Model(rule)
    ids, labels = _data(steps)
    with tfl.TrainingSession(
        None,
        model,
        optimizer=optimizer or tfl.optim.SGD(lr=2.0),
        hooks=[tfl.StopAtStep(last_step=steps)],
        checkpoint_dir=checkpoint_dir,
        save_checkpoint_steps=1000 if checkpoint_dir else None,
        sparse_optimizer=sparse_optimizer,
    ) as sess:
        while not sess.should_stop():
            start = sess.global_step * BATCH
            xb, yb = ids[start : start + BATCH], labels[start : start + BATCH]
            sess.step(lambda xb=xb, yb=yb: F.cross_entropy(sess.model(xb), yb))
    return model, sess


def _reference(steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The same training by hand: the table on a LocalRowSource with row-sparse sgd (the
    twin of SGD, what a ps applies), the head with torch's SGD; the reference that
    tests/cluster/test_sparse_gradients.py holds a cluster's table to."""
    torch.manual_seed(3)
    model = Model()
    model.embedding.table_name = "embedding"
    LocalRowSource([model.embedding], rule=SparseRowRule("sgd", {"lr": 2.0}))
    optimizer = torch.optim.SGD(model.out.parameters(), lr=2.0)
    ids, labels = _data(steps)
    for step in range(steps):
        xb, yb = ids[step * BATCH : (step + 1) * BATCH], labels[step * BATCH : (step + 1) * BATCH]
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        model.embedding.push_gradient()
        optimizer.step()
    return _all_rows(model.embedding), [p.detach() for p in model.out.parameters()]


def test_a_one_process_session_trains_its_tables_like_the_ps_rule() -> None:
    """The rows change, and equal (bit for bit) the table trained by hand with the row-sparse
    twin of the session's optimizer: what a ps shard applies."""
    initial = _all_rows(_attached(Model()))
    model, sess = _session_run(12)
    assert model.embedding.table_name == "embedding"  # named after its place
    assert sess.global_step == 12
    rows = _all_rows(model.embedding)
    assert not torch.equal(rows, initial)
    want_rows, want_head = _reference(12)
    assert torch.equal(rows, want_rows)
    for got, want in zip(model.out.parameters(), want_head, strict=True):
        assert torch.equal(got.detach(), want)


def _attached(model: Model) -> EmbeddingTable:
    model.embedding.table_name = "embedding"
    LocalRowSource([model.embedding])
    return model.embedding


def test_the_rule_a_one_process_session_gives_its_tables() -> None:
    """Adagrad's twin by default; the table's own rule first; Adam (no twin) refused at
    start, naming the table and the fixes."""
    model, _ = _session_run(2, optimizer=tfl.optim.Adagrad(lr=0.5))
    assert model.embedding.bound_rule == SparseRowRule("adagrad", {"lr": 0.5})
    own = tfl.optim.SparseAdam(lr=0.1)
    model, _ = _session_run(2, optimizer=tfl.optim.Adam(lr=0.01), rule=own)
    assert model.embedding.bound_rule == own
    with pytest.raises(SparseRuleError, match=r"EmbeddingTable 'embedding'.*'adam'.*rule="):
        _session_run(2, optimizer=tfl.optim.Adam(lr=0.01))
    # the session's sparse_optimizer, as in the ps modes, for a table without its own rule
    session_rule = tfl.optim.SparseAdam(lr=0.05)
    model, _ = _session_run(2, optimizer=tfl.optim.Adam(lr=0.01), sparse_optimizer=session_rule)
    assert model.embedding.bound_rule == session_rule
    model, _ = _session_run(
        2, optimizer=tfl.optim.Adam(lr=0.01), rule=own, sparse_optimizer=session_rule
    )
    assert model.embedding.bound_rule == own


def test_a_table_attached_before_the_session_is_reattached_and_said_so(caplog) -> None:
    model = Model()
    model.embedding.table_name = "embedding"
    LocalRowSource([model.embedding], rule=SparseRowRule("sgd", {"lr": 0.5}))
    session = tfl.TrainingSession(None, model, optimizer=tfl.optim.SGD(lr=0.1))
    with caplog.at_level(logging.WARNING, logger="tensorfleet.local"), session as sess:
        ids = torch.tensor([1, 2, 3])
        before = _all_rows(model.embedding)
        sess.step(lambda: sess.model(ids).pow(2).mean())
        assert not torch.equal(_all_rows(model.embedding), before)
    assert "attached to a row source before the session" in caplog.text
    assert model.embedding.bound_rule == SparseRowRule("sgd", {"lr": 0.1})


def test_checkpoint_holds_the_rows_restores_them_and_load_table_rows_reads_them(
    tmp_path: Path,
) -> None:
    """A run cut in two by a checkpoint ends where the uninterrupted run ends (rows too);
    ``tfl.load_table_rows`` returns the checkpoint's created rows, sorted by id."""
    whole, _ = _session_run(8)
    _session_run(5, checkpoint_dir=tmp_path)  # the final checkpoint at step 5
    ids, values = tfl.load_table_rows(tmp_path, "embedding")
    assert ids.dtype == torch.int64 and values.shape == (ids.numel(), DIM)
    assert torch.equal(ids, torch.sort(ids).values) and ids.numel() > 0
    resumed, sess = _session_run(8, checkpoint_dir=tmp_path)
    assert sess.global_step == 8
    assert torch.equal(_all_rows(resumed.embedding), _all_rows(whole.embedding))
    # the final checkpoint (step 8): the created rows as the model has them
    newest_ids, newest_values = tfl.load_table_rows(tmp_path, "embedding")
    assert torch.equal(newest_values, _all_rows(resumed.embedding)[newest_ids])
    with pytest.raises(CheckpointError, match=r"no embedding table 'users'.*\['embedding'\]"):
        tfl.load_table_rows(tmp_path, "users")


def test_a_checkpoint_without_the_models_tables_is_refused(tmp_path: Path) -> None:
    """The same dense parameters, saved by a model without the table: refused, naming both."""

    class HeadOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(DIM, CLASSES)

    with tfl.TrainingSession(None, HeadOnly(), tfl.optim.SGD(lr=0.1), checkpoint_dir=tmp_path):
        pass
    session = tfl.TrainingSession(None, Model(), tfl.optim.SGD(lr=0.1), checkpoint_dir=tmp_path)
    with pytest.raises(CheckpointError, match=r"tables \[\], the model has \['embedding'\]"):
        session.start()


def test_lookups_no_backward_reached_push_no_rows() -> None:
    """A lookup whose output never entered a loss gives no rows (torch gives no gradient):
    with lazy Adam a zero-gradient row would still move through its moments."""
    table = EmbeddingTable(10, 3, name="t")
    LocalRowSource([table], rule=tfl.optim.SparseAdam(lr=0.1))
    table(torch.tensor([1])).sum().backward()
    table.push_gradient()  # row 1 now has moments
    before = _all_rows_of(table)
    table(torch.tensor([1]))  # looked up in training mode, never backpropagated
    sent = table.push_gradient()
    assert sent.indices.numel() == 0
    assert torch.equal(_all_rows_of(table), before)
    # rows of a lookup the backward reached stay, zero gradients included (as nn.Embedding)
    out = table(torch.tensor([2, 3]))
    (out[0] * 0).sum().backward()
    assert table.push_gradient().indices.tolist() == [2, 3]


def _all_rows_of(table: EmbeddingTable) -> torch.Tensor:
    with torch.no_grad():
        return table(torch.arange(table.num_rows)).clone()


def test_table_errors_name_the_table_the_value_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"'users': partition must be.*got 'ranges'.*fix"):
        EmbeddingTable(10, 3, name="users", partition="ranges")
    with pytest.raises(ConfigError, match=r"unnamed EmbeddingTable\(10, 3\).*got 'ranges'"):
        EmbeddingTable(10, 3, partition="ranges")
    with pytest.raises(
        ConfigError, match="rule must be a row-sparse rule.*got the dense rule 'sgd'"
    ):
        EmbeddingTable(10, 3, rule=tfl.optim.SGD(lr=0.1))
    with pytest.raises(TableNotAttached, match=r"unnamed EmbeddingTable\(10, 3\).*fix"):
        EmbeddingTable(10, 3)(torch.tensor([1]))


def test_log_placement_lists_tables_with_their_rows_per_shard() -> None:
    model = Model()
    TableAttachment(find_tables(model), LocalRowSource([], num_shards=2), num_shards=2)
    specs = [VariableSpec(n, tuple(p.shape), "float32", 4) for n, p in model.named_parameters()]
    text = placement_report(model, plan=plan_placement(specs, 2, "greedy", None), task="worker:0")
    assert "table     embedding   [40, 4]" in text
    assert "ps:0,ps:1 (rows mod 2)" in text
    assert "table 'embedding': 40 x 4 float32, rows split by mod over 2 ps shard(s)" in text
    assert "ps:1  embedding" in text and "20 rows" in text


def test_one_process_log_placement_shows_local_rows(capsys) -> None:
    with tfl.TrainingSession(None, Model(), optimizer=tfl.optim.SGD(lr=0.1), log_placement=True):
        pass
    out = capsys.readouterr().out
    assert "table     embedding" in out and "local (rows)" in out


@pytest.mark.parametrize(
    ("heading", "printed"),
    [
        ("### In one process", "embedding SparseRowRule(name='sgd', hyperparameters={'lr': 0.1})"),
        ("### Reading a table's rows from a checkpoint", "[5, 9] [2, 8]"),
        ("#### Creating every row ahead: `EmbeddingTable.create_all_rows()`", "1000 rows created"),
        (
            "#### Admission in a fixed amount of memory: `admission_filter=tfl.AdmissionFilter(...)`",
            "2 0\n(4792530, 7)",
        ),
    ],
)
def test_the_documented_one_process_examples_run(capsys, heading: str, printed: str) -> None:
    """docs/sparse.md's examples of these sections, as written, print what the page says."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "sparse.md").read_text()
    section = text.split(heading + "\n", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "docs/sparse.md", "exec"), {})  # noqa: S102 - our own document
    assert printed in capsys.readouterr().out


def test_an_export_holds_each_tables_rows_beside_the_parameters(tmp_path: Path) -> None:
    """``tfl.export_checkpoint`` writes the parameters and, for each embedding table, its
    created rows' ids and values (they were left out, without a word)."""
    from safetensors.torch import load_file

    _session_run(6, checkpoint_dir=tmp_path / "ckpt")
    exported = load_file(str(tfl.export_checkpoint(tmp_path / "ckpt", tmp_path / "m.safetensors")))
    ids, rows = tfl.load_table_rows(tmp_path / "ckpt", "embedding")
    assert sorted(exported) == ["embedding.ids", "embedding.rows", "out.bias", "out.weight"]
    assert torch.equal(exported["embedding.ids"], ids) and ids.numel() > 0
    assert torch.equal(exported["embedding.rows"], rows) and rows.shape == (ids.numel(), DIM)


def test_cluster_stats_in_one_process_gives_the_tables_numbers_as_a_shard_does() -> None:
    """A new user's code read ``cluster_stats()[k]["tables"]`` on a cluster and got ``[]``
    in one process: now one record of the rows held here, in the same shape."""
    torch.manual_seed(3)
    model = Model()
    ids, labels = _data(3)
    with tfl.TrainingSession(None, model, optimizer=tfl.optim.SGD(lr=2.0)) as sess:
        sess.step(lambda: F.cross_entropy(sess.model(ids[:BATCH]), labels[:BATCH]))
        (record,) = sess.cluster_stats()
    numbers = record["tables"]["embedding"]
    assert record["mode"] == "local" and record["peak_rss_bytes"] > 0
    assert numbers["rows_live"] == ids[:BATCH].unique().numel() and numbers["bytes"] > 0
