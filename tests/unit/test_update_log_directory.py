"""Where a launch's ps tasks keep their update log (``launch/update_log_directory.py``): by
default a directory of the launch under ``/dev/shm`` (here: a directory of the test),
removed at the end, orphans of killed launchers removed by the next launch; ``DIR`` kept;
``off`` none; what the tasks' environment gets for each, and what a ps started by hand
accepts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet import environment
from tensorfleet.errors import ConfigError, LaunchConfigError
from tensorfleet.launch.cli import build_parser, server_update_log_dir
from tensorfleet.launch.launch_command import launch_env
from tensorfleet.launch.update_log_directory import (
    PREFIX,
    choose,
    process_start,
    remove_orphans,
)


@pytest.fixture(autouse=True)
def _no_inherited_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(environment.PS_UPDATE_LOG_VAR, raising=False)
    monkeypatch.delenv(environment.PS_UPDATE_LOG_SNAPSHOT_VAR, raising=False)


def test_by_default_a_directory_of_the_launch_is_made_and_removed_at_the_end(
    tmp_path: Path,
) -> None:
    chosen = choose(None, "local", root=tmp_path)
    assert chosen.owned and chosen.path is not None and chosen.path.is_dir()
    assert chosen.path.parent == tmp_path
    assert chosen.path.name.startswith(f"{PREFIX}{os.getpid()}-{process_start(os.getpid())}-")
    assert str(chosen.path) in chosen.line and "removed at the end" in chosen.line
    (chosen.path / "ps-0.00000001.updatelog").write_bytes(b"x" * 100)
    chosen.remove()
    assert not chosen.path.exists()


def test_a_directory_given_is_kept_and_off_is_no_log(tmp_path: Path) -> None:
    given = choose(str(tmp_path / "logs"), "local", root=tmp_path)
    assert given.path == tmp_path / "logs" and not given.owned
    assert "kept after the run" in given.line
    given.path.mkdir()
    given.remove()
    assert given.path.is_dir()  # the user's directory stays
    for word in ("off", "0", "OFF", "none"):
        off = choose(word, "local", root=tmp_path)
        assert off.path is None and "ps update log: off" in off.line, word
    for empty in (" ", ""):
        with pytest.raises(LaunchConfigError, match="--ps-update-log is empty"):
            choose(empty, "local", root=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["logs"]  # nothing made for those


def test_the_launchers_own_environment_chooses_when_the_flag_is_not_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(environment.PS_UPDATE_LOG_VAR, str(tmp_path / "from-env"))
    assert choose(None, "local", root=tmp_path).path == tmp_path / "from-env"
    assert choose("off", "local", root=tmp_path).path is None  # the flag wins
    monkeypatch.setenv(environment.PS_UPDATE_LOG_VAR, "off")
    chosen = choose(None, "local", root=tmp_path)
    assert chosen.path is None and environment.PS_UPDATE_LOG_VAR in chosen.line
    monkeypatch.setenv(environment.PS_UPDATE_LOG_VAR, "auto")
    assert choose(None, "local", root=tmp_path).owned


def test_auto_is_no_log_on_ray_and_where_the_root_cannot_be_written(tmp_path: Path) -> None:
    ray = choose(None, "ray", root=tmp_path)
    assert ray.path is None and "ray backend" in ray.line and "--ps-update-log DIR" in ray.line
    missing = choose(None, "local", root=tmp_path / "no-such-root")
    assert missing.path is None and "missing or not writable" in missing.line
    assert choose(str(tmp_path / "d"), "ray", root=tmp_path).path == tmp_path / "d"
    assert list(tmp_path.iterdir()) == []


def _launch_directories(root: Path) -> tuple[Path, Path, Path, Path]:
    """Under ``root``: a directory of a launcher that is gone, one of a pid now reused (this
    process's, another start time), one of this live process, and one not a launch's."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    own = f"{os.getpid()}-{process_start(os.getpid())}"
    dead = root / f"{PREFIX}{gone.pid}-{12345}-aaaa"
    reused = root / f"{PREFIX}{os.getpid()}-1-bbbb"
    alive = root / f"{PREFIX}{own}-cccc"
    other = root / "tensorfleet-something-else"
    for path in (dead, reused, alive, other):
        path.mkdir()
        (path / "ps-0.00000001.updatelog").write_bytes(b"x" * 8192)
    return dead, reused, alive, other


def test_the_directories_of_launchers_that_are_gone_are_removed_and_the_others_kept(
    tmp_path: Path,
) -> None:
    dead, reused, alive, other = _launch_directories(tmp_path)
    removed = remove_orphans(tmp_path)
    assert sorted(path for path, _ in removed) == sorted([dead, reused])
    assert all(size >= 8192 for _, size in removed)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other.name])


@pytest.mark.parametrize("choice", ["auto", "off", "a directory"])
def test_a_local_launch_removes_the_orphans_whatever_its_choice_and_says_so(
    tmp_path: Path, choice: str
) -> None:
    """A user who turned the log off (e.g. for a small /dev/shm) still gets the memory of a
    killed launcher's directory back (the trial of this change found it kept)."""
    root = tmp_path / "shm"
    root.mkdir()
    dead, reused, alive, _ = _launch_directories(root)
    flag = {"auto": None, "off": "off", "a directory": str(tmp_path / "kept")}[choice]
    chosen = choose(flag, "local", root=root)
    assert not dead.exists() and not reused.exists() and alive.is_dir()
    assert chosen.cleanup is not None, chosen
    assert chosen.cleanup.startswith(
        f"removed 2 ps update log directories of launches that are gone from {root}"
    )
    assert dead.name in chosen.cleanup and reused.name in chosen.cleanup
    assert choose("off", "local", root=root).cleanup is None  # nothing left to remove
    assert choose("off", "ray", root=root).cleanup is None  # not this host's to clean
    chosen.remove()


def test_the_tasks_get_the_chosen_directory_or_an_empty_value_when_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = build_parser()
    args = parser.parse_args(["launch", "--", "python", "t.py"])
    chosen = choose(None, "local", root=tmp_path)
    assert launch_env(args, chosen) == {environment.PS_UPDATE_LOG_VAR: str(chosen.path)}
    off = choose("off", "local", root=tmp_path)
    assert launch_env(args, off) == {environment.PS_UPDATE_LOG_VAR: ""}  # nothing inherited
    sized = parser.parse_args(["launch", "--ps-update-log-snapshot", "1G", "--", "t"])
    assert launch_env(sized, chosen)[environment.PS_UPDATE_LOG_SNAPSHOT_VAR] == "1G"
    with pytest.raises(LaunchConfigError, match="no effect without an update log"):
        launch_env(sized, off)
    monkeypatch.setenv(environment.PS_UPDATE_LOG_SNAPSHOT_VAR, "1G")  # the same, inherited
    assert launch_env(args, chosen)[environment.PS_UPDATE_LOG_VAR] == str(chosen.path)
    with pytest.raises(LaunchConfigError, match="TENSORFLEET_PS_UPDATE_LOG_SNAPSHOT=1G has no"):
        launch_env(args, off)
    chosen.remove()


def test_a_ps_started_by_hand_takes_a_directory_or_off_and_refuses_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert server_update_log_dir(str(tmp_path)) == str(tmp_path)
    assert server_update_log_dir("off") is None
    assert server_update_log_dir(None) is None
    monkeypatch.setenv(environment.PS_UPDATE_LOG_VAR, str(tmp_path))
    assert server_update_log_dir(None) == str(tmp_path)
    assert server_update_log_dir("off") is None  # the option wins
    monkeypatch.setenv(environment.PS_UPDATE_LOG_VAR, "")  # the launcher's off
    assert server_update_log_dir(None) is None
    monkeypatch.setenv(environment.PS_UPDATE_LOG_VAR, "no")  # an off word
    assert server_update_log_dir(None) is None
    with pytest.raises(ConfigError, match="--update-log auto: auto is tensorfleet launch's"):
        server_update_log_dir("auto")
    monkeypatch.setenv(environment.PS_UPDATE_LOG_VAR, "auto")
    with pytest.raises(ConfigError, match="TENSORFLEET_PS_UPDATE_LOG auto"):
        server_update_log_dir(None)
