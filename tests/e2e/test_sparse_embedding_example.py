"""The ``nn.Embedding(sparse=True)`` example end to end through the launcher: its weight held
as rows on 2 ps shards, 2 sync workers; the held-out loss falls and the final checkpoint
loads strictly into a fresh model, the weight reassembled whole from the shards' rows."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import run_local_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sparse_embedding.py"


def test_sparse_embedding_learns_and_its_checkpoint_loads_strictly(tmp_path):
    command = [
        sys.executable, str(EXAMPLE), "--steps", "150", "--mode", "sync",
        "--checkpoint-dir", str(tmp_path / "checkpoints"),
    ]  # fmt: skip
    run = run_local_cluster(2, 2, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    lines = [line for line in run.output.of("worker:0") if line.startswith("held-out mse")]
    assert len(lines) == 1, str(run)
    before, after = map(float, re.search(r"before ([0-9.]+), after ([0-9.]+)", lines[0]).groups())
    assert after < 0.8 * before, f"{lines[0]}\n{run}"
    assert "[200000, 16], loaded strictly" in lines[0]
    placement = "\n".join(run.output.of("worker:0"))
    assert "embedding.weight  [200000, 16]  ps:0,ps:1 (rows mod 2)" in placement, str(run)


def test_without_a_checkpoint_dir_its_temporary_one_is_removed(tmp_path):
    """Each worker's default checkpoint directory is a temporary one, gone when it ends."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    command = [sys.executable, str(EXAMPLE), "--steps", "20"]
    run = run_local_cluster(2, 2, command, timeout_s=200, env={"TMPDIR": str(temporary)})
    assert run.returncode == 0, str(run)
    assert any(line.startswith("held-out mse") for line in run.output.of("worker:0")), str(run)
    assert not list(temporary.glob("sparse-embedding-*")), str(run)
