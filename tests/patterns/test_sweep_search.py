"""The sweep's parts without trial processes: Optuna resume (real Optuna, SQLite storage),
pruner options, the grid's size line, the parameter keys, progress lines, the plot notice."""

from __future__ import annotations

import importlib.util
import io

import pytest

from tensorfleet.patterns.search import COMPLETE, OptunaSearch, resumed_sampler_seed
from tensorfleet.patterns.search_space import SweepConfigError, grid_summary, parse_space
from tensorfleet.patterns.study_storage import open_study_storage
from tensorfleet.patterns.sweep import Sweep
from tensorfleet.patterns.sweep_config import SweepConfig, load_config
from tensorfleet.patterns.sweep_report import PlainProgress, TrialRecord, why_no_plot


def optuna_config(sampler: str, trials: int = 6) -> SweepConfig:
    return SweepConfig(
        entry="m:f",
        space={
            "x": {"type": "float", "low": 0.0, "high": 10.0},
            "width": {"type": "int", "low": 1, "high": 1000},
        },
        metric="loss",
        search="optuna",
        sampler=sampler,
        trials=trials,
        seed=0,
        slots=2,
    )


def _key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_a_resumed_optuna_study_runs_no_configuration_twice(tmp_path, sampler):
    optuna = pytest.importorskip("optuna")
    cfg = optuna_config(sampler)
    first = OptunaSearch(cfg, tmp_path)
    assert first.seed_note is None and first.sampler_seed == 0
    planned = [first.next_trial(running=i) for i in range(4)]
    for trial in planned[:2]:
        first.finish(trial, COMPLETE, trial.params["x"])
    # Trials 2 and 3 stay RUNNING in the study, as a SIGKILLed sweep leaves them.
    resumed = OptunaSearch(cfg, tmp_path)
    assert resumed.interrupted == [2, 3]
    assert resumed.seed_note is not None and "seeded with" in resumed.seed_note
    assert resumed.sampler_seed == resumed_sampler_seed(0, 4) != 0
    started = []
    while (trial := resumed.next_trial(running=0)) is not None:
        started.append(trial)
        resumed.finish(trial, COMPLETE, trial.params["x"])
    assert [_key(t.params) for t in started[:2]] == [_key(t.params) for t in planned[2:]], (
        "the interrupted configurations run again first"
    )
    storage, _ = open_study_storage(optuna, tmp_path)
    study = optuna.load_study(study_name="sweep", storage=storage)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 6
    keys = [_key(t.params) for t in complete]
    assert len(set(keys)) == 6, f"a configuration ran twice: {keys}"

    # A fresh study with the same seed draws the first run's configurations again.
    (tmp_path / "fresh").mkdir()
    again = OptunaSearch(cfg, tmp_path / "fresh")
    assert [_key(again.next_trial(running=i).params) for i in range(4)] == [
        _key(t.params) for t in planned
    ]


def test_pruner_options_errors_name_the_file_and_the_accepted_options(tmp_path):
    pytest.importorskip("optuna")
    path = tmp_path / "slow.yaml"
    path.write_text(
        "entry: m:f\nspace: {x: [1, 2]}\nmetric: loss\nsearch: optuna\ntrials: 4\n"
        "pruner: median\npruner_options: {n_startup: 4}\n"
    )
    with pytest.raises(SweepConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert str(path) in message and "'n_startup'" in message, message
    for option in ("n_startup_trials", "n_warmup_steps", "interval_steps", "n_min_trials"):
        assert option in message, message
    with pytest.raises(SweepConfigError, match=r"cannot be negative.*MedianPruner takes"):
        SweepConfig(
            **{**_settings(), "pruner": "median", "pruner_options": {"n_startup_trials": -1}}
        )
    with pytest.raises(SweepConfigError, match="given but pruner is 'none'"):
        SweepConfig(**{**_settings(), "pruner_options": {"n_startup_trials": 2}})


def _settings() -> dict:
    return {
        "entry": "m:f",
        "space": {"x": [1, 2]},
        "metric": "loss",
        "search": "optuna",
        "trials": 4,
    }


def test_the_grid_line_says_how_many_trials_and_which_ranges_use_the_default():
    space = parse_space(
        {
            "lr": {"type": "loguniform", "low": 1e-4, "high": 1e-1},
            "dropout": {"type": "float", "low": 0.0, "high": 0.5, "grid": 3},
            "width": [32, 64],
            "layers": {"type": "int", "low": 1, "high": 5, "step": 2},
        }
    )
    assert grid_summary(space) == (
        "grid search: 90 trials (lr 5 x dropout 3 x width 2 x layers 3); lr: 5 points (the "
        "default; set grid: N on the parameter for another number)"
    )
    assert grid_summary(parse_space({"width": [32, 64]})) == "grid search: 2 trials (width 2)"


def test_keys_a_parameter_kind_does_not_use_are_refused():
    with pytest.raises(SweepConfigError, match=r"unknown keys \['step'\] for type float"):
        parse_space({"lr": {"type": "float", "low": 0.1, "high": 1.0, "step": 0.1}})
    with pytest.raises(SweepConfigError, match=r"unknown keys \['low'\] for type choice"):
        parse_space({"w": {"type": "choice", "values": [1, 2], "low": 0}})
    with pytest.raises(SweepConfigError, match="a linear int range tries every step"):
        parse_space({"n": {"type": "int", "low": 1, "high": 9, "grid": 3}})
    with pytest.raises(SweepConfigError, match="log: false contradicts it"):
        parse_space({"lr": {"type": "loguniform", "low": 0.1, "high": 1.0, "log": False}})
    logint = parse_space({"n": {"type": "int", "low": 1, "high": 1000, "log": True, "grid": 4}})
    assert logint["n"].grid_values() == [1, 10, 100, 1000]


def test_a_value_reported_without_a_step_is_shown_without_one():
    lines = io.StringIO()
    progress = PlainProgress("accuracy", lines)
    progress.updated(TrialRecord(1, {"seed": 1}, value=0.755))
    progress.updated(TrialRecord(2, {"seed": 2}, value=0.5, step=50))
    assert lines.getvalue().splitlines() == [
        "trial    1 accuracy=0.755",
        "trial    2 step 50 accuracy=0.5",
    ]


def test_no_plot_says_why_when_matplotlib_is_installed():
    pytest.importorskip("matplotlib")
    failed = [TrialRecord(0, {"x": 1}, state="failed", error="exited with status 1")]
    assert why_no_plot(failed, "loss") == "no trial reported a value of 'loss'"


def test_env_and_pythonpath_of_the_wrong_shape_are_refused(tmp_path):
    with pytest.raises(SweepConfigError, match=r"env must map variable names to strings.*quote"):
        SweepConfig(entry="m:f", space={"x": [1]}, metric="m", env={"OMP_NUM_THREADS": 1})
    path = tmp_path / "s.yaml"
    path.write_text("entry: m:f\nspace: {x: [1]}\nmetric: m\npythonpath: src\n")
    with pytest.raises(
        SweepConfigError, match=r"s\.yaml: pythonpath must be a list of directories"
    ):
        load_config(path)


def test_a_pythonpath_entry_that_does_not_exist_is_refused_with_where_it_was_looked_for(
    tmp_path, monkeypatch
):
    """Before, a misspelt entry was accepted and every trial failed on its import."""
    (tmp_path / "src").mkdir()
    path = tmp_path / "s.yaml"
    path.write_text("entry: m:f\nspace: {x: [1]}\nmetric: m\npythonpath: [src, scr]\n")
    with pytest.raises(SweepConfigError) as refused:
        load_config(path)
    message = str(refused.value)
    assert "s.yaml: pythonpath names 1 path(s) that do not exist" in message, message
    assert str(tmp_path.resolve() / "scr") in message and "correct or remove" in message
    assert f"taken from the config file's directory, {tmp_path.resolve()}" in message, message
    path.write_text("entry: m:f\nspace: {x: [1]}\nmetric: m\npythonpath: [src]\n")
    assert str(tmp_path.resolve() / "src") in load_config(path).pythonpath
    monkeypatch.chdir(tmp_path)  # the Python API: relative to the working directory
    with pytest.raises(SweepConfigError, match=r"'lib'.*taken from the working directory"):
        SweepConfig(**{**_settings(), "pythonpath": ["src", "lib"]})


def test_a_sampler_whose_package_is_missing_is_refused_up_front():
    if importlib.util.find_spec("cmaes") is not None:
        pytest.skip("the cmaes package is installed here")
    with pytest.raises(
        SweepConfigError, match=r"sampler: cmaes needs the package\(s\) \['cmaes'\].*pip install"
    ):
        SweepConfig(**{**_settings(), "sampler": "cmaes"})


def test_results_csv_says_why_an_interrupted_trials_number_has_no_result(tmp_path):
    import csv
    import json

    from tensorfleet.patterns.sweep_report import write_results

    # An Optuna sweep killed while trial 2 ran: the resumed study ran its configuration
    # again as trial 4, and trial 2's files were moved aside.
    left = tmp_path / "interrupted" / "0002-1"
    left.mkdir(parents=True)
    (left / "params.json").write_text(json.dumps({"number": 2, "params": {"x": 0.5}}))
    records = [
        TrialRecord(n, {"x": x}, state=COMPLETE, value=x, seconds=1.0)
        for n, x in ((0, 1.0), (1, 2.0), (3, 3.0), (4, 0.5))
    ]
    document = write_results(tmp_path, records, "loss", "minimize")
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["trial"], r["state"]) for r in rows] == [
        ("0", "complete"),
        ("1", "complete"),
        ("2", "interrupted"),
        ("3", "complete"),
        ("4", "complete"),
    ]
    assert rows[2]["x"] == "0.5" and rows[2]["loss"] == "" and rows[2]["seconds"] == ""
    assert "ran its configuration again as a new trial" in rows[2]["error"], rows[2]
    assert "interrupted/0002-1" in rows[2]["error"], rows[2]
    assert document["counts"] == {"complete": 4, "pruned": 0, "failed": 0}
    assert document["interrupted"][0]["trial"] == 2 and document["best"]["trial"] == 4


def test_a_list_search_file_may_leave_the_space_out_and_others_may_not(tmp_path):
    listed = tmp_path / "listed.yaml"
    listed.write_text(
        "entry: t:f\nmetric: score\nsearch: list\n"
        "configurations: [{kind: a, n: 1}, {kind: b, n: 2}]\n"
    )
    config = load_config(listed)
    assert set(config.space) == {"kind", "n"}  # each parameter: a choice of its values
    assert [c["kind"] for c in config.configurations] == ["a", "b"]
    assert config.total_trials == 2
    grid = tmp_path / "grid.yaml"
    grid.write_text("entry: t:f\nmetric: score\n")
    with pytest.raises(SweepConfigError, match="missing setting 'space'"):
        load_config(grid)


def test_a_misspelt_setting_is_refused_with_the_setting_meant(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text('{"entry": "m:f", "space": {"x": [1, 2]}, "metric": "loss", "slot": 2}')
    with pytest.raises(
        SweepConfigError, match=r"unknown settings \['slot'\] \('slot': did you mean 'slots'\?\)"
    ):
        load_config(path)


def test_a_resume_with_another_configuration_names_both_values(tmp_path):
    first = SweepConfig(**{**_settings(), "search": "grid", "trials": None})
    Sweep(first, tmp_path, PlainProgress("loss", io.StringIO()))._prepare()
    other = SweepConfig(**{**_settings(), "search": "grid", "trials": None, "metric": "error"})
    with pytest.raises(
        SweepConfigError, match=r"differs in \['metric'\]: metric: 'loss' there, 'error' now"
    ):
        Sweep(other, tmp_path, PlainProgress("loss", io.StringIO()))._prepare()
