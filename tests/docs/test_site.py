"""The documentation site builds with ``mkdocs build --strict`` (a broken link or API
reference fails), its API reference covers the public facade, and the Slurm how-to shows
the commands the real Slurm test runs."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tensorfleet
from tests.clusters_real import test_slurm

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def build(config_dir: Path, site: Path) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: run `make setup` (or pip install -e '.[docs]')")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=config_dir,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_the_site_builds_strictly(tmp_path):
    run = build(ROOT, tmp_path / "site")
    assert run.returncode == 0, run.stdout + run.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "Find which task of which cluster this process is" in reference  # a docstring
    # Sphinx roles in docstrings render as code (scripts/mkdocs_sphinx_roles.py), linked
    # where the page documents the object, under the facade's name too.
    roles = re.findall(r":(?:class|func|meth|mod|data|attr|exc):<code>[^<]*</code>", reference)
    assert roles == [], roles[:5]
    assert '<a href="#tensorfleet.Preempted"><code>Preempted</code></a>' in reference


def test_a_broken_api_reference_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy)
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    (copy / "src").symlink_to(ROOT / "src")
    with open(copy / "docs" / "reference.md", "a") as page:
        page.write("\n::: tensorfleet.NoSuchName\n")
    run = build(copy, tmp_path / "site")
    assert run.returncode != 0 and "NoSuchName" in run.stdout + run.stderr


def test_the_reference_covers_every_public_name():
    page = (ROOT / "docs" / "reference.md").read_text()
    documented = set(re.findall(r"^::: tensorfleet\.(\w+)$", page, flags=re.MULTILINE))
    public = set(tensorfleet.__all__) - {"__version__"}
    assert documented == public, (
        f"docs/reference.md lacks {sorted(public - documented)} and has extra "
        f"{sorted(documented - public)}"
    )


def test_the_slurm_howto_shows_the_commands_the_test_runs():
    page = (ROOT / "docs" / "howto" / "slurm.md").read_text()
    assert test_slurm.REPORT_EXIT in page
    assert f"examples/mnist_cnn.py --steps {test_slurm.STEPS}" in page
    for key in ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SlurmdParameters=config_overrides"):  # fmt: skip
        assert key in page
