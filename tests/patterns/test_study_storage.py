"""The Optuna sweep's study: a journal file with the sweep's own lock, its torn tail cut on
open, and a sweep begun on SQLite resumed on SQLite."""

from __future__ import annotations

import pytest

from tensorfleet.patterns.search import COMPLETE, OptunaSearch
from tensorfleet.patterns.study_storage import (
    JOURNAL_FILE,
    SQLITE_FILE,
    cut_torn_tail,
    open_study_storage,
    sqlite_storage,
)
from tensorfleet.patterns.sweep_config import SweepConfig

optuna = pytest.importorskip("optuna")


def config(trials: int = 6) -> SweepConfig:
    return SweepConfig(
        entry="m:f",
        space={"x": {"type": "float", "low": 0.0, "high": 10.0}},
        metric="loss",
        search="optuna",
        sampler="tpe",
        trials=trials,
        seed=0,
    )


def run_trials(search: OptunaSearch, count: int) -> list[float]:
    values = []
    for _ in range(count):
        trial = search.next_trial(running=0)
        assert trial is not None
        search.finish(trial, COMPLETE, trial.params["x"])
        values.append(trial.params["x"])
    return values


def test_a_new_optuna_sweep_keeps_its_study_in_a_journal_without_a_lock_file(tmp_path):
    search = OptunaSearch(config(), tmp_path)
    run_trials(search, 3)
    search.close()
    assert (tmp_path / JOURNAL_FILE).exists() and not (tmp_path / SQLITE_FILE).exists()
    assert not list(tmp_path.glob("*.lock")), "the sweep's flock is the journal's lock"
    storage, note = open_study_storage(optuna, tmp_path)
    assert note is None
    study = optuna.load_study(study_name="sweep", storage=storage)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3


def test_a_torn_last_line_is_cut_and_the_study_reads_and_writes_on(tmp_path):
    search = OptunaSearch(config(), tmp_path)
    run_trials(search, 2)
    search.close()
    journal = tmp_path / JOURNAL_FILE
    whole = journal.read_bytes()
    journal.write_bytes(whole + b'{"op_code": 5, "worker_id": "x", "trial_i')  # a torn append
    resumed = OptunaSearch(config(), tmp_path)
    assert resumed.storage_note is not None, "the cut is said"
    assert "ended in a torn line (41 bytes" in resumed.storage_note, resumed.storage_note
    after = journal.read_bytes()
    assert after.startswith(whole) and b'"trial_i' not in after[len(whole) :], (
        "exactly the torn tail was cut"
    )
    run_trials(resumed, 2)  # appends after the cut are readable
    resumed.close()
    storage, note = open_study_storage(optuna, tmp_path)
    assert note is None
    study = optuna.load_study(study_name="sweep", storage=storage)
    assert len([t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]) == 4


def test_cut_torn_tail_leaves_whole_files_alone(tmp_path):
    assert cut_torn_tail(tmp_path / "missing") is None
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert cut_torn_tail(empty) is None
    whole = tmp_path / "whole"
    whole.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    assert cut_torn_tail(whole) is None and whole.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    only_torn = tmp_path / "only_torn"
    only_torn.write_bytes(b'{"a": ')
    assert "6 bytes" in cut_torn_tail(only_torn) and only_torn.read_bytes() == b""


def test_a_sweep_begun_on_sqlite_resumes_on_sqlite(tmp_path):
    study = optuna.create_study(
        study_name="sweep", storage=sqlite_storage(optuna, tmp_path / SQLITE_FILE)
    )
    study.enqueue_trial({"x": 1.5})
    trial = study.ask()
    trial.suggest_float("x", 0.0, 10.0)
    study.tell(trial, 1.5)
    search = OptunaSearch(config(), tmp_path)
    assert search.seed_note is not None and "holds 1 trial(s)" in search.seed_note
    run_trials(search, 2)
    search.close()
    assert not (tmp_path / JOURNAL_FILE).exists(), "an existing SQLite study is kept"
    reread = optuna.load_study(study_name="sweep", storage=f"sqlite:///{tmp_path / SQLITE_FILE}")
    assert len(reread.trials) == 3
