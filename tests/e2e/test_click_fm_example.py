"""The factorization-machine example end to end through the launcher: its 1M-row table on
2 ps shards, 2 workers; the held-out AUC must be well above chance, and every step's lookup
but the first was sent ahead with the step before's exchange."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import run_local_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "click_fm.py"


def test_click_fm_learns_through_the_launcher():
    run = run_local_cluster(2, 2, [sys.executable, str(EXAMPLE), "--steps", "300"], timeout_s=200)
    assert run.returncode == 0, str(run)
    lines = [line for line in run.output.of("worker:0") if line.startswith("held-out:")]
    assert len(lines) == 1, str(run)
    auc = float(re.search(r"AUC ([0-9.]+) \(known", lines[0]).group(1))
    assert auc > 0.6, f"held-out AUC {auc} (0.5 is chance)\n{run}"
    # Each worker's lookups after its first came ahead, with its step before's exchange: of
    # the 300 steps (however the two workers shared them), all but each worker's first.
    used_by_both = 0
    for worker in ("worker:0", "worker:1"):
        (ahead,) = [line for line in run.output.of(worker) if "lookups sent ahead" in line]
        used, missed = map(int, re.search(r"(\d+) used, (\d+) missed", ahead).groups())
        assert missed == 0, f"{worker}: {ahead}\n{run}"
        used_by_both += used
    assert used_by_both >= 298, f"{used_by_both} lookups used ahead\n{run}"


def test_click_fm_with_raw_ids_learns_and_admits_and_evicts_rows():
    """``--raw-ids``: ids over the whole int64 range, a row per id after 2 updates, evicted
    after 200 steps unseen; it still learns, and the table admitted and evicted rows."""
    command = [sys.executable, str(EXAMPLE), "--steps", "300", "--raw-ids"]
    command += ["--admit-after", "2", "--expire-after-steps", "200"]  # not the defaults
    run = run_local_cluster(2, 2, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    lines = run.output.of("worker:0")
    held_out = [line for line in lines if line.startswith("held-out:")]
    assert len(held_out) == 1, str(run)
    auc = float(re.search(r"AUC ([0-9.]+) \(known", held_out[0]).group(1))
    assert auc > 0.6, f"held-out AUC {auc} (0.5 is chance)\n{run}"
    table = next(line for line in lines if line.startswith("raw-id table:"))
    numbers = {
        key: int(value.replace(",", ""))
        for value, key in re.findall(r"([0-9,]+) (rows live|admitted|evicted|dropped rows)", table)
    }
    assert numbers["admitted"] > numbers["rows live"] > 0, table
    assert numbers["evicted"] == numbers["admitted"] - numbers["rows live"], table
    assert numbers["dropped rows"] > 0, table


def test_click_fm_with_rows_ahead_and_prefetch_learns():
    """``--rows-ahead --prefetch``: both workers ask the shards to create every row of the
    1M-row table before their first step (the counts they print add up to the table's rows:
    each row created once), every step leaves its replies in flight, and it still learns."""
    command = [sys.executable, str(EXAMPLE), "--steps", "300", "--rows-ahead", "--prefetch"]
    run = run_local_cluster(2, 2, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    created = 0
    for worker in ("worker:0", "worker:1"):
        (line,) = [line for line in run.output.of(worker) if "rows created ahead" in line]
        created += int(line.rsplit(" ", 1)[1].replace(",", ""))
    assert created == 1_000_000, str(run)
    assert "is off for this model" not in str(run), str(run)
    held_out = [line for line in run.output.of("worker:0") if line.startswith("held-out:")]
    assert len(held_out) == 1, str(run)
    auc = float(re.search(r"AUC ([0-9.]+) \(known", held_out[0]).group(1))
    assert auc > 0.6, f"held-out AUC {auc} (0.5 is chance)\n{run}"


def test_click_fm_refuses_rows_ahead_with_raw_ids():
    """A table of raw ids has no fixed rows to create: the example says so when it reads its
    arguments, before any task starts, instead of every worker failing in its session."""
    import subprocess

    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--raw-ids", "--rows-ahead"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert "--rows-ahead creates the rows of a table of row numbers" in done.stderr, done.stderr
