"""The click example's ``--raw-ids`` table learns as well as its table of row numbers.

Both trained in one process (deterministic: the same batches, the same rule), 300 steps as
the documented run: with the example's defaults (a row at the first lookup, no expiry) the
raw-id table gives every id a row of its own exactly as the table of row numbers does, so
the held-out AUC may differ only by which random initial value each row gets (the rows are
keyed by the spread ids, not by row numbers): within 0.01, the spread measured over
initializer seeds being about 0.003. Admission and expiry (``--admit-after 2
--expire-after-steps 200``) are what cost AUC on this data (docs/sparse.md), which the
second test shows so that a change making them free would be noticed and documented.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tensorfleet as tfl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from click_fm import BATCH, FactorizationMachine, auc, make_clicks, spread  # noqa: E402

pytestmark = pytest.mark.timeout(180)

STEPS = 300


def held_out_auc(raw: dict | None) -> tuple[float, dict]:
    """Train the example's model in one process; the held-out AUC and the table's stats."""
    ids_of = spread if raw is not None else (lambda ids: ids)
    model = FactorizationMachine(raw)
    with tfl.TrainingSession(
        None, model, optimizer=tfl.optim.Adagrad(lr=0.1),
        hooks=[tfl.StopAtStep(last_step=STEPS)], progress_secs=None,
    ) as sess:  # fmt: skip
        seed = 1000
        while not sess.should_stop():
            ids, labels, _ = make_clicks(BATCH, seed)
            seed += 1
            x = ids_of(ids)
            sess.step(lambda x=x, y=labels: F.binary_cross_entropy_with_logits(model(x), y))
        stats = sess._updater.row_source.shards[0].store("embedding").stats()
        ids, labels, _ = make_clicks(20_000, seed=7)
        with torch.no_grad():
            return auc(model(ids_of(ids)), labels), stats


def test_raw_ids_with_the_example_defaults_learn_as_well_as_row_numbers():
    hashed, _ = held_out_auc(None)
    raw, stats = held_out_auc({"ids": "raw", "admit_after": 0, "expire_after_steps": None})
    assert raw >= hashed - 0.01, f"raw-id AUC {raw:.4f}, row numbers {hashed:.4f}"
    assert stats["evicted"] == 0 and stats["dropped_rows"] == 0, stats


def test_admission_and_expiry_cost_auc_on_this_data():
    free, _ = held_out_auc({"ids": "raw", "admit_after": 0, "expire_after_steps": None})
    gated, stats = held_out_auc({"ids": "raw", "admit_after": 2, "expire_after_steps": 200})
    assert stats["dropped_rows"] > 0 and stats["evicted"] > 0, stats
    assert gated < free - 0.01, f"admit_after=2, expiry 200: {gated:.4f}; neither: {free:.4f}"
