"""``scripts/gpu_machine.sh`` explains itself: ``--help`` says what each step does and where
it runs (exit 0), and a wrong or missing step gets the same text on stderr (exit 2). Nothing
is downloaded or installed here."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_machine.sh"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, check=False
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_says_what_each_step_does(flag: str) -> None:
    done = _run(flag)
    assert done.returncode == 0, done.stderr
    for fragment in ("prepare", "run", ".gpu-wheels", ".gpu-data", "benchmarks/gpu.py", "$OUT"):
        assert fragment in done.stdout, done.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [(), ("bogus",)])
def test_a_wrong_step_is_refused_with_the_usage(args: tuple[str, ...]) -> None:
    done = _run(*args)
    assert done.returncode == 2
    assert "prepare" in done.stderr and ".gpu-wheels" in done.stderr, done.stderr
