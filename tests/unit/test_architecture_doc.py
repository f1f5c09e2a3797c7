"""docs/architecture.md, "Adding an update mode": its example of a mode registered from user
code runs as written, in one process (where the mode's ``build`` is not called) and on a
cluster of one ps and one worker under ``tensorfleet launch`` (where every push is noisy);
and the limits it states are the code's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet import environment
from tensorfleet.errors import ConfigError
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.session.update_modes import MODE_OPTIONS

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]


def section() -> str:
    """The text of the "Adding an update mode" section, up to the next heading."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("\n### Adding an update mode\n")
    end = text.index("\n### ", start + 1)
    return text[start:end]


def example() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", section(), flags=re.DOTALL)
    return code


def _environment() -> dict[str, str]:
    """This process's environment without anything that names a task or a cluster."""
    names = (environment.TF_CONFIG_VAR, "SLURM_PROCID", "SLURM_JOB_ID")
    return {k: v for k, v in os.environ.items() if k not in names}


def test_the_example_runs_in_one_process_without_calling_build() -> None:
    run = subprocess.run(
        [sys.executable, "-c", example()],
        cwd=ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "local: global step 200, noisy pushes 0"
    assert "`local: global step 200, noisy pushes 0`" in section()


@pytest.mark.e2e
def test_the_example_trains_through_a_ps_under_the_launcher() -> None:
    command = [sys.executable, "-m", "tensorfleet", "launch", "--ps", "1", "--workers", "1"]
    launcher = subprocess.Popen(
        [*command, "--", sys.executable, "-c", example()],
        cwd=ROOT,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = launcher.communicate(timeout=150)
    finally:
        if launcher.poll() is None:  # the launcher stops its tasks on SIGTERM
            os.killpg(launcher.pid, signal.SIGTERM)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    assert launcher.returncode == 0, output
    assert "[worker:0] worker:0: global step 200, noisy pushes 200" in output, output
    assert "`worker:0: global step 200, noisy pushes 200`" in section()


def test_the_limits_it_states_are_the_codes() -> None:
    text = " ".join(section().split())
    with pytest.raises(ConfigError, match=re.escape("mode must be one of ('async', 'sync')")):
        UpdateDiscipline(mode="noisy")
    assert '`UpdateDiscipline(mode="noisy")` raises `ConfigError: mode must be one of' in text
    listed = re.search(r"the session options only some modes take: ([^)]*)\)", text)
    assert listed is not None
    assert re.findall(r"`(\w+)`", listed.group(1)) == list(MODE_OPTIONS)
