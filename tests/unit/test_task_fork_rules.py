"""Which commands and environments the launcher's task fork server can serve (the pure rules
of tensorfleet.launch.backends.task_forks; the processes: tests/e2e/test_task_forks.py)."""

from __future__ import annotations

import os
import sys

from tensorfleet.launch.backends.task_forks import (
    ForkableCommand,
    forkable,
    forks_enabled,
    import_time_difference,
)


def test_this_interpreter_with_a_script_or_a_module_is_forkable() -> None:
    assert forkable([sys.executable, "train.py", "--steps", "3"]) == ForkableCommand(
        "script", "train.py", ["--steps", "3"]
    )
    assert forkable([sys.executable, "-u", "-m", "tensorfleet", "server"]) == ForkableCommand(
        "module", "tensorfleet", ["server"], unbuffered=True
    )


def test_a_bare_python_counts_only_when_path_finds_exactly_this_interpreter(tmp_path) -> None:
    name = os.path.basename(sys.executable)
    here = os.path.dirname(sys.executable)
    assert forkable([name, "train.py"], path=here) == ForkableCommand("script", "train.py")
    other = tmp_path / name
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    why = forkable([name, "train.py"], path=str(tmp_path))
    assert isinstance(why, str) and "is not this interpreter" in why


def test_a_relative_program_path_is_the_tasks_working_directorys() -> None:
    here, name = os.path.split(sys.executable)
    up, last = os.path.split(here)
    relative = os.path.join(last, name)
    assert forkable([relative, "t.py"], cwd=up) == ForkableCommand("script", "t.py")
    assert isinstance(forkable([relative, "t.py"], cwd="/"), str)


def test_anything_else_is_said_not_forkable() -> None:
    for command, words in (
        ([], "empty"),
        (["/bin/sh", "run.sh"], "is not this interpreter"),
        ([sys.executable], "interactive"),
        ([sys.executable, "-m"], "names no module"),
        ([sys.executable, "-X", "dev", "train.py"], "'-X'"),
        ([sys.executable, "-c", "print(1)"], "'-c'"),
    ):
        why = forkable(command)
        assert isinstance(why, str) and words in why, (command, why)


def test_only_variables_read_at_import_or_by_c_libraries_must_match() -> None:
    started = {"HOME": "/root", "OMP_NUM_THREADS": "2", "TF_CONFIG": "a", "SEEN": "1"}
    same_but_identity = {**started, "TF_CONFIG": "b", "PYTHONPATH": "x", "PYTHONUNBUFFERED": "1"}
    assert import_time_difference(started, same_but_identity, {"SEEN"}) == []
    other = {**started, "OMP_NUM_THREADS": "1", "SEEN": "2", "PYTHONHASHSEED": "0"}
    assert import_time_difference(started, other, {"SEEN"}) == [
        "OMP_NUM_THREADS",
        "PYTHONHASHSEED",
        "SEEN",
    ]
    assert import_time_difference(
        started, {k: v for k, v in started.items() if k != "SEEN"}, {"SEEN"}
    ) == ["SEEN"]


def test_the_variable_turns_forks_off_and_they_are_off_but_on_linux() -> None:
    assert not forks_enabled({}, platform="darwin")
    assert forks_enabled({}, platform="linux")
    assert forks_enabled({"TENSORFLEET_TASK_FORKS": "1"}, platform="linux")
    for off in ("0", "false", "No", " off "):
        assert not forks_enabled({"TENSORFLEET_TASK_FORKS": off}, platform="linux")
