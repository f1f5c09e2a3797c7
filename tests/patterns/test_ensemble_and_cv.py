"""An ensemble of 3 members and 3-fold cross-validation, each member/fold its own process."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from tensorfleet.errors import TensorfleetError
from tensorfleet.patterns.cross_validation import fold_indices, run_cross_validation
from tensorfleet.patterns.ensemble import run_ensemble
from tensorfleet.patterns.sweep_report import PlainProgress
from tensorfleet.patterns.trial import load_trial_tensors

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

PROGRAMS = [str(Path(__file__).parent / "programs")]


def quiet(metric: str = "accuracy") -> PlainProgress:
    return PlainProgress(metric, io.StringIO())


def test_an_ensemble_of_three_reports_member_and_ensemble_accuracy(tmp_path):
    members = [{"seed": 0}, {"seed": 1}, {"seed": 2}]
    result = run_ensemble(
        "model_trials:member",
        members,
        tmp_path / "ens",
        slots=2,
        pythonpath=PROGRAMS,
        progress=quiet(),
    )
    assert [m["state"] for m in result.members] == ["complete"] * 3, result.members
    assert [m["params"] for m in result.members] == members
    # Recompute everything from the kept predictions, independently of run_ensemble.
    kept = [
        load_trial_tensors(tmp_path / "ens" / "trials" / f"{i:04d}", "predictions")
        for i in range(3)
    ]
    for m, k in zip(result.members, kept, strict=True):
        assert m["accuracy"] == pytest.approx(
            float((k["probs"].argmax(1) == k["labels"]).float().mean())
        )
        assert 0.5 < m["accuracy"] <= 1.0, "each member learned something"
    average = torch.stack([k["probs"] for k in kept]).mean(0)
    assert result.ensemble_accuracy == pytest.approx(
        float((average.argmax(1) == kept[0]["labels"]).float().mean())
    )
    assert len({m["accuracy"] for m in result.members}) > 1, "the members differ"
    document = json.loads((tmp_path / "ens" / "ensemble.json").read_text())
    assert (
        document["ensemble_accuracy"] == result.ensemble_accuracy and len(document["members"]) == 3
    )


def test_three_fold_cross_validation_validates_every_sample_once(tmp_path):
    n = 300
    result = run_cross_validation(
        "model_trials:fold",
        3,
        n,
        tmp_path / "cv",
        seed=5,
        slots=2,
        pythonpath=PROGRAMS,
        progress=quiet(),
    )
    assert len(result.scores) == 3 and all(0.5 < s <= 1.0 for s in result.scores), result
    assert result.mean == pytest.approx(sum(result.scores) / 3)
    assert result.std == pytest.approx(torch.tensor(result.scores).std().item())
    seen = torch.cat(
        [
            load_trial_tensors(tmp_path / "cv" / "trials" / f"{i:04d}", "validation_indices")[
                "indices"
            ]
            for i in range(3)
        ]
    )
    assert sorted(seen.tolist()) == list(range(n))
    # Folds are a pure function of (n, k, fold, seed): disjoint, and the same every time.
    parts = [fold_indices(n, 3, i, 5)[1] for i in range(3)]
    assert sorted(torch.cat(parts).tolist()) == list(range(n))
    assert torch.equal(parts[1], fold_indices(n, 3, 1, 5)[1])


def test_folds_that_validate_a_sample_twice_are_refused(tmp_path):
    with pytest.raises(
        TensorfleetError, match=r"200 never validated .* 100 validated more than once"
    ):
        run_cross_validation(
            "model_trials:wrong_fold",
            3,
            300,
            tmp_path / "cv",
            slots=2,
            pythonpath=PROGRAMS,
            progress=quiet(),
        )


def test_a_failed_fold_is_named_with_its_directory_and_reruns_once_that_is_deleted(tmp_path):
    """A fold that failed stays recorded as failed (a run again would keep it); the error
    names its directory, and once that is deleted a run again reruns that fold alone."""
    flag = tmp_path / "may-pass"
    env = {"FOLD_MAY_PASS": str(flag)}

    def run():
        return run_cross_validation(
            "model_trials:fold_failing_once", 3, 300, tmp_path / "cv", seed=5, slots=2,
            pythonpath=PROGRAMS, env=env, progress=quiet(),
        )  # fmt: skip

    with pytest.raises(TensorfleetError, match=r"fold 1: .*fold one broke.*trials/0001"):
        run()
    flag.touch()
    with pytest.raises(TensorfleetError, match="fold 1"):
        run()  # still recorded as failed
    shutil.rmtree(tmp_path / "cv" / "trials" / "0001")
    result = run()
    assert len(result.scores) == 3 and all(0.5 < s <= 1.0 for s in result.scores), result


def test_an_entry_module_that_starts_the_ensemble_at_import_is_told_where_the_call_belongs(
    tmp_path,
):
    """The snippet written as one file, without the ``__main__`` guard: each member's trial
    imports the module, which starts the same ensemble again. Every member fails saying so,
    and the run's error says how to run a failed member again."""
    programs = tmp_path / "programs"
    programs.mkdir()
    directory = tmp_path / "ens"
    (programs / "unguarded_members.py").write_text(
        "import sys\n"
        "from tensorfleet.patterns.ensemble import run_ensemble\n"
        f"sys.path.insert(0, {PROGRAMS[0]!r})\n"
        "from model_trials import member  # noqa: E402\n"
        f"run_ensemble('unguarded_members:member', [{{'seed': 0}}, {{'seed': 1}}], {str(directory)!r},\n"
        f"             pythonpath=[{str(programs)!r}])\n"
    )
    with pytest.raises(TensorfleetError) as raised:
        run_ensemble(
            "unguarded_members:member", [{"seed": 0}, {"seed": 1}], directory, pythonpath=[str(programs)],
            progress=quiet(),
        )  # fmt: skip
    text = str(raised.value)
    assert "started that sweep again" in text and '__name__ == "__main__"' in text, text
    assert f"{directory}/trials/0000" in text and f"{directory}/trials/0001" in text, text
