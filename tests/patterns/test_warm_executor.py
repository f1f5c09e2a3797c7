"""Trials forked from a slot's preloaded executor: reuse, isolation, and what a failure costs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tensorfleet.patterns.search_space import SweepConfigError
from tensorfleet.patterns.sweep import run_sweep
from tensorfleet.patterns.sweep_config import SweepConfig
from tensorfleet.patterns.sweep_report import PlainProgress
from tensorfleet.patterns.trial_processes import TrialProcesses

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(150)]

PROGRAMS = str(Path(__file__).parent / "programs")


def sweep(tmp_path: Path, modes: list[str], **overrides):
    settings = {
        "entry": "warm_trials:where",
        "space": {},
        "configurations": [{"n": i, "mode": m} for i, m in enumerate(modes)],
        "search": "list",
        "metric": "value",
        "slots": 1,
        "pythonpath": [PROGRAMS],
    }
    settings.update(overrides)
    cfg = SweepConfig(**settings)
    lines = io.StringIO()
    result = run_sweep(cfg, tmp_path / "sweep", progress=PlainProgress(cfg.metric, lines))
    return result, lines.getvalue()


def where(tmp_path: Path, number: int) -> dict:
    return json.loads((tmp_path / "sweep" / "trials" / f"{number:04d}" / "where.json").read_text())


def test_one_slot_runs_its_trials_in_forks_of_one_preloaded_executor(tmp_path):
    result, log = sweep(tmp_path, ["ok"] * 4)
    assert [r.state for r in result.records] == ["complete"] * 4, log
    assert [r.value for r in result.records] == [0.0, 1.0, 2.0, 3.0], log
    seen = [where(tmp_path, n) for n in range(4)]
    executors = {s["ppid"] for s in seen}
    assert len(executors) == 1, f"one executor serves the slot: {seen}"
    # The module was imported once, by that executor, not by each trial ...
    assert {s["imported_by"] for s in seen} == executors, seen
    # ... and each trial is a process of its own that starts from the executor's state.
    assert len({s["pid"] for s in seen}) == 4, seen
    assert all(s["state_seen"] is None for s in seen), "a trial saw another trial's global"
    assert all(s["slot"] == "0" for s in seen), seen
    output = (tmp_path / "sweep" / "trials" / "0002" / "output.log").read_text()
    assert f"trial 2 in pid {seen[2]['pid']}" in output, output
    assert not (tmp_path / "sweep" / "lock").exists(), "the lock file is removed at the end"


def test_two_slots_run_their_trials_at_once_in_forks_of_one_shared_executor(tmp_path):
    # Each "meet" trial completes only while its partner runs beside it (else it fails after
    # 60 s): the shared executor must wait for both at once, not fork one after the other.
    result, log = sweep(tmp_path, ["meet"] * 4, slots=2)
    assert [r.state for r in result.records] == ["complete"] * 4, log
    seen = [where(tmp_path, n) for n in range(4)]
    assert len({s["ppid"] for s in seen}) == 1, f"one executor serves both slots: {seen}"
    assert {s["imported_by"] for s in seen} == {seen[0]["ppid"]}, seen
    assert {s["slot"] for s in seen} == {"0", "1"}, seen


def test_a_failing_trial_costs_only_itself_and_the_next_trial_runs(tmp_path):
    modes = ["ok", "raise", "ok", "exit", "ok", "kill", "ok", "hang", "ok"]
    result, log = sweep(tmp_path, modes, trial_timeout_s=4.0)
    by_number = result.by_number()
    states = [by_number[n].state for n in range(len(modes))]
    assert states == [
        "complete",
        "failed",
        "complete",
        "failed",
        "complete",
        "failed",
        "complete",
        "failed",
        "complete",
    ], log
    assert by_number[1].error == "RuntimeError: trial 1 raises on purpose", by_number[1]
    assert by_number[3].error.startswith("exited with status 7"), by_number[3]
    assert by_number[5].error == "killed by SIGKILL", by_number[5]
    assert by_number[7].error == "timed out after 4 s", by_number[7]
    error = json.loads((tmp_path / "sweep" / "trials" / "0001" / "error.json").read_text())
    assert "raises on purpose" in error["traceback"], error
    # None of them took the executor with it: every trial was forked by the same one.
    assert len({where(tmp_path, n)["ppid"] for n in range(len(modes))}) == 1, log


def test_a_killed_executor_costs_its_running_trial_and_is_replaced(tmp_path):
    result, log = sweep(tmp_path, ["ok", "kill_executor", "ok", "ok"])
    by_number = result.by_number()
    assert [by_number[n].state for n in range(4)] == [
        "complete",
        "failed",
        "complete",
        "complete",
    ], log
    error = by_number[1].error
    assert "the slot's executor process" in error and "was killed by SIGKILL" in error, error
    assert "the trial was killed with it" in error, error
    before, after = where(tmp_path, 0)["ppid"], where(tmp_path, 2)["ppid"]
    assert before != after, "the slot's next trial runs on a new executor"
    assert where(tmp_path, 3)["ppid"] == after, log
    assert "starting a new executor" in log, log


def test_an_entry_module_that_starts_threads_is_run_in_fresh_processes(tmp_path):
    result, log = sweep(
        tmp_path,
        ["ok", "ok"],
        entry="threaded_import:train",
        configurations=[{"n": 0}, {"n": 1}],
    )
    assert [r.state for r in result.records] == ["complete", "complete"], log
    assert "trials run in fresh processes: importing 'threaded_import' started 1 thread(s)" in log
    for n in range(2):
        seen = where(tmp_path, n)
        assert seen["imported_by"] == seen["pid"], "each trial imported the module itself"


def test_executor_fresh_runs_each_trial_in_a_new_interpreter(tmp_path):
    result, log = sweep(tmp_path, ["ok", "ok"], executor="fresh")
    assert [r.state for r in result.records] == ["complete", "complete"], log
    for n in range(2):
        seen = where(tmp_path, n)
        assert seen["imported_by"] == seen["pid"], seen
    with pytest.raises(SweepConfigError, match=r"executor must be one of warm, fresh; got 'hot'"):
        SweepConfig(entry="a:b", space={"x": [1]}, metric="m", executor="hot")


def test_the_sweep_knows_while_its_first_trial_waits_for_the_executors_import(tmp_path):
    """What the sweep imports its plotting library during (a core the import leaves free):
    from the executor's start until it says it is ready, never after."""
    go = tmp_path / "go"
    cfg = SweepConfig(
        entry="gated_entry:trial", space={}, configurations=[{"n": 0}], search="list",
        metric="value", pythonpath=[PROGRAMS], env={"GATED_ENTRY_GO": str(go)},
    )  # fmt: skip
    processes = TrialProcesses(cfg, PlainProgress(cfg.metric, io.StringIO()))
    try:
        processes.start_executors()
        assert processes.still_importing()  # its module's import waits for the file
        go.touch()
        assert processes.check_entry() == []  # waits for the executor's ready event
        assert not processes.still_importing()
    finally:
        processes.close()
