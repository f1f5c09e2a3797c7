"""Sweeps with real trial processes: the table, failures, resume after a kill, Optuna pruning."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorfleet.patterns.search_space import SweepConfigError
from tensorfleet.patterns.sweep import run_sweep
from tensorfleet.patterns.sweep_config import SweepConfig, load_config
from tensorfleet.patterns.sweep_report import PlainProgress

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

PROGRAMS = str(Path(__file__).parent / "programs")


def config(**overrides) -> SweepConfig:
    settings = {
        "entry": "sweep_trials:quadratic",
        "space": {"x": [0, 1, 2, 3]},
        "metric": "loss",
        "slots": 2,
        "pythonpath": [PROGRAMS],
    }
    settings.update(overrides)
    return SweepConfig(**settings)


def run(cfg: SweepConfig, directory: Path):
    lines = io.StringIO()
    result = run_sweep(cfg, directory, progress=PlainProgress(cfg.metric, lines))
    return result, lines.getvalue()


def test_four_configurations_over_two_slots_give_the_right_table(tmp_path):
    result, log = run(config(), tmp_path / "sweep")
    by_number = result.by_number()
    assert sorted(by_number) == [0, 1, 2, 3], log
    for record in by_number.values():
        assert record.state == "complete", log
        assert record.value == (record.params["x"] - 1) ** 2, log
        assert record.slot in (0, 1)
    assert result.best == {"trial": 1, "value": 0.0, "params": {"x": 1}}
    with open(result.results_csv) as f:
        rows = list(csv.DictReader(f))
    assert [(r["trial"], r["state"], float(r["loss"]), r["x"]) for r in rows] == [
        ("0", "complete", 1.0, "0"),
        ("1", "complete", 0.0, "1"),
        ("2", "complete", 1.0, "2"),
        ("3", "complete", 4.0, "3"),
    ]
    document = json.loads(result.results_json.read_text())
    assert document["best"]["params"] == {"x": 1} and document["counts"]["complete"] == 4
    assert result.plot is not None and result.plot.stat().st_size > 0
    assert "trial    3 complete" in log and "best loss=0" in log, log
    assert "sweep: grid search: 4 trials (x 4)" in log, log


def test_a_raising_trial_and_a_killed_trial_are_recorded_and_the_sweep_completes(tmp_path):
    cfg = config(space={"x": [0, 1], "mode": ["ok", "raise", "kill"]})
    result, log = run(cfg, tmp_path / "sweep")
    records = list(result.records)
    assert len(records) == 6, log
    raised = [r for r in records if r.params["mode"] == "raise"]
    killed = [r for r in records if r.params["mode"] == "kill"]
    fine = [r for r in records if r.params["mode"] == "ok"]
    assert all(r.state == "failed" for r in raised + killed), log
    assert all("ValueError: trial with x=" in r.error for r in raised), raised
    assert all(r.error == "killed by SIGKILL" for r in killed), killed
    assert all(r.state == "complete" for r in fine) and len(fine) == 2, log
    assert result.best["params"] == {"x": 1, "mode": "ok"}
    document = json.loads(result.results_json.read_text())
    assert document["counts"] == {"complete": 2, "pruned": 0, "failed": 4}


def test_exit_status_3_means_pruned_only_from_an_entry_point_or_when_asked(tmp_path):
    # A command exiting 3 on its own in a grid sweep (no pruner) failed, with its output.
    cfg = config(
        entry=None,
        command=[
            "{python}",
            "-c",
            "from tensorfleet.patterns.trial import current_trial; "
            "current_trial().report(0, loss=0.2); print('giving up'); raise SystemExit(3)",
        ],
        space={"x": [0]},
    )
    result, log = run(cfg, tmp_path / "command")
    (record,) = result.records
    assert record.state == "failed", log
    assert record.error == "exited with status 3: giving up", log
    # An entry point that raised TrialPruned (trial_main exits 3) is pruned.
    result, log = run(config(space={"x": [0], "mode": ["ok", "prune"]}), tmp_path / "entry")
    assert [r.state for r in result.records] == ["complete", "pruned"], log


def test_a_sweep_without_a_completed_trial_exits_1_and_says_why_there_is_no_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "fail.json"
    path.write_text(
        json.dumps(
            {
                "command": ["{python}", "-c", "raise SystemExit(5)"],
                "space": {"x": [0]},
                "metric": "loss",
            }
        )
    )
    status = subprocess.run(
        [sys.executable, "-m", "tensorfleet", "sweep", str(path), "--dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 1, status
    assert "no trial of the sweep completed" in status.stderr, status.stderr
    assert "0 complete, 0 pruned, 1 failed" in status.stdout, status.stdout
    assert "(no plot: no trial reported a value of 'loss')" in status.stdout, status.stdout
    assert "matplotlib" not in status.stdout, status.stdout


def test_a_missing_entry_is_refused_before_any_trial_starts(tmp_path):
    # One slot: the verdict is slot 0's executor's; a second executor (torch and its
    # optimizer imports, seconds) would only be started and stopped again.
    with pytest.raises(SweepConfigError) as caught:
        run(config(entry="no_such_mod:train", slots=1), tmp_path / "module")
    message = str(caught.value)
    assert "entry 'no_such_mod:train': there is no module 'no_such_mod'" in message, message
    assert PROGRAMS in message and "pythonpath" in message, message
    with pytest.raises(
        SweepConfigError,
        match=r"entry 'sweep_trials:quadratc': 'sweep_trials' \(.*sweep_trials.py\) has no "
        r"attribute 'quadratc' \(did you mean 'quadratic'\?\); fix the function name",
    ):
        run(config(entry="sweep_trials:quadratc", slots=1), tmp_path / "function")
    assert not (tmp_path / "module").exists() and not (tmp_path / "function").exists()


def test_a_missing_entry_in_an_existing_directory_removes_only_what_the_sweep_added(tmp_path):
    # The sweep opens its study while the executor imports the entry; refused, it takes back
    # what it wrote, so that the corrected config is not refused as another configuration.
    directory = tmp_path / "existing"
    directory.mkdir()
    (directory / "notes.txt").write_text("mine")
    with pytest.raises(SweepConfigError, match="there is no module 'no_such_mod'"):
        run(config(entry="no_such_mod:train", search="optuna", trials=2), directory)
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt"]
    result, _ = run(config(search="optuna", trials=2), directory)
    assert [r.state for r in result.records] == ["complete"] * 2


def test_bad_input_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(
        SweepConfigError, match=r"unknown parameter type 'gaussian'.*choice, int, float, loguniform"
    ):
        config(space={"x": {"type": "gaussian", "low": 0, "high": 1}})
    with pytest.raises(SweepConfigError, match="the parameter space is empty"):
        config(space={})
    with pytest.raises(SweepConfigError, match="needs trials"):
        config(search="random")
    with pytest.raises(SweepConfigError, match=r"names \{y\}, which is not a parameter"):
        config(entry=None, command=["python", "t.py", "--y={y}"])
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps({"space": {"x": {"type": "gaussian"}}, "metric": "m", "entry": "a:b"})
    )
    status = subprocess.run(
        [sys.executable, "-m", "tensorfleet", "sweep", str(path), "--dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 2, status
    assert "unknown parameter type 'gaussian'" in status.stderr, status.stderr
    assert not (tmp_path / "d").exists(), "nothing may start before the config is valid"


def _gated_sweep(tmp_path: Path) -> tuple[list[str], dict[str, str], Path]:
    """``tensorfleet sweep`` of 4 trials in 2 slots of ``sweep_trials:gated``: trials 0 and 1
    finish, 2 and 3 wait for ``tmp_path/gate``, each completion is written to
    ``tmp_path/completions.txt``. The command, its environment and the sweep's directory."""
    cfg_path = tmp_path / "sweep.yaml"
    cfg_path.write_text(
        "entry: sweep_trials:gated\n"
        "space: {x: [0, 1, 2, 3]}\n"
        "metric: loss\n"
        "slots: 2\n"
        f"pythonpath: [{PROGRAMS}]\n"
    )
    directory = tmp_path / "sweep"
    env = dict(
        os.environ,
        SWEEP_TEST_GATE=str(tmp_path / "gate"),
        SWEEP_TEST_COMPLETIONS=str(tmp_path / "completions.txt"),
    )
    argv = [sys.executable, "-m", "tensorfleet", "sweep", str(cfg_path), "--dir", str(directory),
            "--no-live"]  # fmt: skip
    return argv, env, directory


def test_a_killed_sweep_resumes_without_running_a_finished_trial_again(tmp_path):
    gate, completions = tmp_path / "gate", tmp_path / "completions.txt"
    argv, env, directory = _gated_sweep(tmp_path)
    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids = []
    try:
        # Wait (with a deadline) until trials 0 and 1 finished and 2 and 3 run, blocked.
        deadline = time.monotonic() + 60
        trials = directory / "trials"
        while not (
            (trials / "0000" / "result.json").exists()
            and (trials / "0001" / "result.json").exists()
            and (trials / "0002" / "metrics.jsonl").exists()
            and (trials / "0003" / "metrics.jsonl").exists()
        ):
            assert first.poll() is None, first.communicate()[0].decode()
            assert time.monotonic() < deadline, "the first two trials did not finish in 60 s"
            time.sleep(0.05)
        pids = [int((trials / n / "pid").read_text()) for n in ("0002", "0003")]
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # The blocked trials died with the sweep (parent-death signal).
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"trial processes {pids} outlived the sweep"
        time.sleep(0.05)
    # trials 0 and 1 run side by side (two slots): either may finish first
    assert sorted(completions.read_text().splitlines()) == ["x=0", "x=1"]

    gate.touch()
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming" in second.stdout and "2 trial(s) already finished" in second.stdout, (
        second.stdout
    )
    assert sorted(completions.read_text().splitlines()) == ["x=0", "x=1", "x=2", "x=3"], (
        "every trial completes exactly once across the two runs"
    )
    document = json.loads((directory / "results.json").read_text())
    assert [t["state"] for t in document["trials"]] == ["complete"] * 4
    assert document["best"]["params"] == {"x": 0}
    assert sorted(p.name for p in (directory / "interrupted").iterdir()) == ["0002-1", "0003-1"]


def test_a_sweep_stopped_by_sigterm_exits_130_saying_how_to_resume(tmp_path):
    argv, env, directory = _gated_sweep(tmp_path)  # no gate: trials 2 and 3 wait for it
    sweep = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (directory / "trials" / "0002" / "metrics.jsonl").exists():
            assert sweep.poll() is None, sweep.communicate()[0].decode()
            assert time.monotonic() < deadline, "trial 2 did not start in 60 s"
            time.sleep(0.05)
        sweep.send_signal(signal.SIGTERM)
        output = sweep.communicate(timeout=60)[0].decode()
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert sweep.returncode == 130, output
    assert f"sweep: interrupted; the trials that finished are kept in {directory}" in output, output
    assert "run the same command again to resume" in output, output


def test_an_optuna_sweep_with_a_median_pruner_prunes_and_resumes_from_its_study(tmp_path):
    pytest.importorskip("optuna")
    cfg = config(
        entry="sweep_trials:slow_curve",
        space={"x": {"type": "float", "low": 0.0, "high": 10.0}},
        search="optuna",
        sampler="random",
        trials=6,
        seed=3,
        pruner="median",
        pruner_options={"n_startup_trials": 2, "n_warmup_steps": 1},
    )
    result, log = run(cfg, tmp_path / "sweep")
    states = [r.state for r in result.records]
    assert len(states) == 6 and "pruned" in states, log
    assert states.count("failed") == 0, log
    pruned = [r for r in result.records if r.state == "pruned"]
    assert all(r.step is not None and r.step < 14 for r in pruned), "a pruned trial stops early"
    import optuna

    from tensorfleet.patterns.study_storage import open_study_storage

    storage, _ = open_study_storage(optuna, tmp_path / "sweep")
    study = optuna.load_study(study_name="sweep", storage=storage)
    assert (tmp_path / "sweep" / "study.journal").exists(), "a new sweep keeps a journal"
    assert len(study.trials) == 6
    assert sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials) == len(pruned)
    # Running the finished sweep again starts nothing.
    again, log = run(cfg, tmp_path / "sweep")
    assert again.started_now == [] and len(again.records) == 6, log


def test_yaml_config_is_read_with_paths_relative_to_it(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        "entry: m:f\nspace: {lr: {type: loguniform, low: 1.0e-4, high: 1.0e-1, grid: 3}}\nmetric: acc\ndirection: maximize\n"
    )
    cfg = load_config(path)
    assert cfg.total_trials == 3 and cfg.direction == "maximize"
    assert str(tmp_path.resolve()) in cfg.pythonpath


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
