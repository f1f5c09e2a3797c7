"""Sweeps whose executors are forked from the program's preloaded interpreter: which sweeps
it serves, fresh user code in each sweep, and what its failures cost."""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path

import pytest

from tensorfleet.errors import LaunchError
from tensorfleet.patterns.preloaded_interpreter import (
    current_preloaded,
    environment_difference,
    preload,
    release_preloaded,
)
from tensorfleet.patterns.preloaded_interpreter_main import _parse_fork_request
from tensorfleet.patterns.sweep import run_sweep
from tensorfleet.patterns.sweep_config import SweepConfig
from tensorfleet.patterns.sweep_report import PlainProgress

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

PROGRAMS = str(Path(__file__).parent / "programs")


@pytest.fixture
def preloaded():
    """The program's preloaded interpreter, started and ready; ended after the test."""
    preload(wait=True)
    interpreter = current_preloaded()
    assert interpreter is not None
    try:
        yield interpreter
    finally:
        release_preloaded()


def sweep(directory: Path, modes: list[str], **overrides):
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
    result = run_sweep(cfg, directory, progress=PlainProgress(cfg.metric, lines))
    return result, lines.getvalue()


def where(directory: Path, number: int) -> dict:
    return json.loads((directory / "trials" / f"{number:04d}" / "where.json").read_text())


def test_each_sweep_forks_its_own_executor_from_the_preloaded_interpreter(tmp_path, preloaded):
    pid = preloaded.process.pid
    executors = []
    for name in ("first", "second"):
        result, log = sweep(tmp_path / name, ["ok", "ok", "ok"])
        assert [r.state for r in result.records] == ["complete"] * 3, log
        assert "executor forked from the preloaded interpreter (pid" in log, log
        seen = [where(tmp_path / name, n) for n in range(3)]
        assert {s["executor_parent"] for s in seen} == {pid}, (seen, pid)
        assert len({s["ppid"] for s in seen}) == 1, seen
        # the sweep's executor imported the entry's module, not the preloaded interpreter
        assert {s["imported_by"] for s in seen} == {seen[0]["ppid"]}, seen
        executors.append(seen[0]["ppid"])
    assert executors[0] != executors[1], "each sweep has an executor of its own"
    assert current_preloaded() is preloaded, "the interpreter outlives the sweeps"


def test_an_edited_entry_module_is_seen_by_the_next_sweep(tmp_path, preloaded):
    programs = tmp_path / "programs"
    programs.mkdir()
    module = programs / "edited_entry.py"
    values = []
    for value in (1.5, 2.5):
        module.write_text(f"def train(trial):\n    return {value}\n")
        cfg = SweepConfig(
            entry="edited_entry:train",
            space={},
            configurations=[{"n": 0}],
            search="list",
            metric="value",
            pythonpath=[str(programs)],
        )
        lines = io.StringIO()
        result = run_sweep(cfg, tmp_path / f"sweep{value}", progress=PlainProgress("value", lines))
        assert result.records[0].state == "complete", lines.getvalue()
        assert "forked from the preloaded interpreter" in lines.getvalue(), lines.getvalue()
        values.append(result.records[0].value)
    assert values == [1.5, 2.5]


def test_a_sweep_whose_environment_differs_starts_its_own_executor_and_says_why(
    tmp_path, preloaded
):
    result, log = sweep(tmp_path / "s", ["ok", "ok"], env={"TENSORFLEET_TEST_FLAG": "b"})
    assert [r.state for r in result.records] == ["complete"] * 2, log
    assert (
        "the preloaded interpreter was started with other values of TENSORFLEET_TEST_FLAG "
        "than this sweep's trials have" in log
    ), log
    seen = where(tmp_path / "s", 0)
    assert seen["executor_parent"] == os.getpid(), seen
    assert seen["flag"] == "b", seen
    # preload(env=...) with the same variables serves such a sweep
    preload(env={"TENSORFLEET_TEST_FLAG": "b"}, wait=True)
    served = current_preloaded()
    assert served is not None and served is not preloaded and not preloaded.alive()
    result, log = sweep(tmp_path / "t", ["ok"], env={"TENSORFLEET_TEST_FLAG": "b"})
    assert result.records[0].state == "complete", log
    seen = where(tmp_path / "t", 0)
    assert seen["executor_parent"] == served.process.pid and seen["flag"] == "b", seen


def test_a_variable_not_read_at_import_is_set_in_the_fork(tmp_path, preloaded, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result, log = sweep(tmp_path / "s", ["ok"], env={"SWEEP_RUNTIME_FLAG": "x"})
    assert result.records[0].state == "complete", log
    seen = where(tmp_path / "s", 0)
    assert seen["executor_parent"] == preloaded.process.pid, (seen, log)
    assert seen["runtime_flag"] == "x", seen
    assert seen["cwd"] == str(tmp_path), "the executor works in the sweep's directory"


def test_a_killed_preloaded_interpreter_costs_only_the_warm_start(tmp_path, preloaded):
    pid = preloaded.process.pid
    os.kill(pid, signal.SIGKILL)
    preloaded.process.wait(timeout=30)
    result, log = sweep(tmp_path / "s", ["ok", "ok"])
    assert [r.state for r in result.records] == ["complete"] * 2, log
    assert (
        f"sweep: the preloaded interpreter (pid {pid}) was killed by SIGKILL; this sweep's "
        "executor imports torch itself" in log
    ), log
    assert current_preloaded() is None, "a dead interpreter is said once, then forgotten"
    assert where(tmp_path / "s", 0)["executor_parent"] == os.getpid(), log
    result, log = sweep(tmp_path / "t", ["ok"])
    assert result.records[0].state == "complete", log
    assert "sweep: the preloaded interpreter" not in log, log


def test_a_killed_forked_executor_costs_its_trial_and_is_forked_again(tmp_path, preloaded):
    result, log = sweep(tmp_path / "s", ["ok", "kill_executor", "ok"])
    by_number = result.by_number()
    assert [by_number[n].state for n in range(3)] == ["complete", "failed", "complete"], log
    error = by_number[1].error
    # its exit status came from the preloaded interpreter, its parent
    assert "the slot's executor process" in error and "was killed by SIGKILL" in error, error
    before, after = where(tmp_path / "s", 0), where(tmp_path / "s", 2)
    assert before["ppid"] != after["ppid"], log
    assert after["executor_parent"] == preloaded.process.pid, (after, log)


def test_preload_wait_says_why_the_interpreter_could_not_start():
    try:
        with pytest.raises(LaunchError) as raised:
            preload(env={"PYTHONHOME": "/nonexistent-python-home"}, wait=True)
    finally:
        release_preloaded()
    message = str(raised.value)
    assert "the preloaded interpreter could not import torch and tensorfleet" in message
    assert "exited with status 1" in message and "Error" in message, message


def test_release_ends_the_interpreter(preloaded):
    release_preloaded()
    preloaded.process.wait(timeout=30)
    assert current_preloaded() is None and not preloaded.alive()


def test_the_interpreter_refuses_a_malformed_fork_request():
    assert _parse_fork_request(b"not json", [3, 4, 5]).startswith("a malformed request")
    good = json.dumps(
        {"fork": {"entry": "m:f", "metric": "loss", "environ": {"A": "1"}, "cwd": "/"}}
    ).encode()
    assert isinstance(_parse_fork_request(good, [3, 4, 5]), dict)
    assert "needs 3 descriptors" in _parse_fork_request(good, [3])
    bad_env = json.dumps(
        {"fork": {"entry": "m:f", "metric": "loss", "environ": {"A": 1}, "cwd": "/"}}
    ).encode()
    assert "must be strings" in _parse_fork_request(bad_env, [3, 4, 5])


def test_environment_difference_names_the_import_time_variables_that_differ():
    assert (
        environment_difference({"OMP_A": "1", "PYTHONPATH": "x"}, {"OMP_A": "1", "PYTHONPATH": "y"})
        == []
    )
    assert environment_difference({"A": "1"}, {"A": "2", "B": "3"}) == []
    started = {"OMP_NUM_THREADS": "2", "PYTHONHASHSEED": "0"}
    wanted = {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "TORCH_HOME": "/t"}
    assert environment_difference(started, wanted) == ["OMP_NUM_THREADS", "TORCH_HOME"]
