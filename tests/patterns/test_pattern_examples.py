"""The ensemble and cross-validation examples run as they are (short settings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_ensemble_example_runs(tmp_path):
    out = run_example(
        "ensemble_members.py", "--members", "3", "--steps", "60", "--dir", str(tmp_path / "e")
    )
    assert out.count(": complete, accuracy 0.") == 3, out
    assert "ensemble of 3: accuracy 0." in out, out
    document = json.loads((tmp_path / "e" / "ensemble.json").read_text())
    assert len(document["members"]) == 3 and 0.5 < document["ensemble_accuracy"] <= 1.0, document
    assert (tmp_path / "e" / "trials" / "0002" / "predictions.safetensors").exists()


def test_the_cross_validation_example_runs(tmp_path):
    out = run_example(
        "cross_validation_folds.py",
        "--k",
        "3",
        "--samples",
        "300",
        "--steps",
        "60",
        "--dir",
        str(tmp_path / "cv"),
    )
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("fold ")] == [
        "fold 0",
        "fold 1",
        "fold 2",
    ], out
    assert "3-fold accuracy 0." in out and "every sample validated once" in out, out
    document = json.loads((tmp_path / "cv" / "cross_validation.json").read_text())
    assert document["metric"] == "accuracy" and len(document["folds"]) == 3, document
    assert (tmp_path / "cv" / "trials" / "0001" / "validation_indices.safetensors").exists()


def test_the_two_sweeps_example_forks_both_executors_from_the_preloaded_interpreter(tmp_path):
    out = run_example(
        "sweeps_in_one_program.py", "--steps", "60", "--trials", "3", "--dir", str(tmp_path / "s")
    )
    lines = out.strip().splitlines()
    assert lines[0].startswith("coarse search: best lr "), out
    assert lines[1].startswith("fine grid: best lr "), out
    assert all(
        line.endswith("executor forked from the preloaded interpreter: True)") for line in lines
    ), out
    assert len(list((tmp_path / "s" / "fine" / "trials").iterdir())) == 5, out


def test_the_two_sweeps_example_without_preload_starts_each_executor(tmp_path):
    out = run_example(
        "sweeps_in_one_program.py",
        *("--steps", "60", "--trials", "2", "--no-preload", "--dir", str(tmp_path / "s")),
    )
    assert out.count("executor forked from the preloaded interpreter: False)") == 2, out
