"""Population-based training (:mod:`tensorfleet.patterns.pbt`): ``tensorfleet pbt CONFIG`` runs
a population from a config file and records its lineage (who copied whom, at which version,
with which hyperparameters); a run killed mid-round (SIGKILL) resumes from its last complete
round with the whole population and ends exactly where an uninterrupted run ends; the
example runs as it is; a wrong configuration is refused naming the field."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet.patterns.pbt_config import PbtConfigError, PopulationConfig, load_config

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = Path(__file__).parent / "programs" / "pbt_problem.py"
MEMBERS, ROUNDS, STEPS = 4, 5, 6
LRS = [0.3, 0.1, 0.03, 0.01]


def write_config(path: Path, **changes: object) -> Path:
    config = {
        "name": "pbt-test",
        "problem": f"{PROBLEM}:make_problem",
        "problem_args": {"kill_member": 2, "kill_at_step": 2 * STEPS + 3},  # in round 3
        "members": MEMBERS,
        "rounds": ROUNDS,
        "steps_per_round": STEPS,
        "rule": "sgd",
        "fixed": {"momentum": 0.5},
        "hyperparameters": {"lr": {"values": LRS, "low": 1e-4, "high": 1.0}},
        "perturb": [0.5, 2.0],
        "seed": 3,
        "round_timeout_s": 120,
        **changes,
    }
    path.write_text(json.dumps(config))
    return path


def run_cli(config: Path, directory: Path, kill: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("PBT_TEST_KILL", None)
    if kill:
        env["PBT_TEST_KILL"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "tensorfleet", "pbt", str(config), "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def check_lineage(directory: Path) -> dict:
    """The lineage's invariants: every round has every member; each copy names a better
    member of its round as its source, at the source's version (its update count, here its
    global step), and the target's new learning rate is the source's times a factor."""
    lineage = json.loads((directory / "lineage.json").read_text())
    assert lineage["members"] == [f"member-{i}" for i in range(MEMBERS)]
    assert len(lineage["rounds"]) == ROUNDS
    for index, members in enumerate(lineage["rounds"]):
        assert [m["round"] for m in members] == [index] * MEMBERS
        assert sorted(m["member"] for m in members) == lineage["members"]
        assert all(m["global_step"] == (index + 1) * STEPS for m in members), members
        by_name = {m["member"]: m for m in members}
        copies = [m for m in members if m["copied_from"] is not None]
        assert len(copies) == (1 if index < ROUNDS - 1 else 0), members  # a quarter of 4
        for copy in copies:
            source = by_name[copy["copied_from"]]
            assert copy["source_score"] == source["score"] == min(m["score"] for m in members)
            assert copy["score"] == max(m["score"] for m in members)
            assert copy["source_version"] == copy["source_global_step"] == source["global_step"]
            ratio = copy["hyperparameters"]["lr"] / source["hyperparameters"]["lr"]
            assert ratio == pytest.approx(0.5) or ratio == pytest.approx(2.0), ratio
    rows = list(csv.DictReader((directory / "lineage.csv").open()))
    assert len(rows) == ROUNDS * MEMBERS and set(rows[0]) >= {"copied_from", "source_version", "lr"}
    assert (directory / "lineage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return lineage


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One uninterrupted run of :func:`write_config`'s configuration (its directory and the
    CLI's result), run once for the module: the lineage test checks it, the resume test
    compares the resumed run with it."""
    base = tmp_path_factory.mktemp("pbt-whole")
    return base / "run", run_cli(write_config(base / "pbt.json"), base / "run")


def test_pbt_runs_from_a_config_file_and_records_the_lineage(tmp_path, whole_run):
    run, done = whole_run
    assert done.returncode == 0, done.stdout + done.stderr
    check_lineage(run)
    result = json.loads((run / "result.json").read_text())
    assert result["exploits"] == ROUNDS - 1 and len(result["scores"]) == MEMBERS, result
    assert json.loads(done.stdout.splitlines()[-1])["best_member"] == result["best_member"]
    # The fixed-hyperparameter runs: the same members, no copy, the initial rates kept.
    fixed = run_cli(write_config(tmp_path / "fixed.json", exploit=False), tmp_path / "fixed")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    lineage = json.loads((tmp_path / "fixed" / "lineage.json").read_text())
    assert all(m["copied_from"] is None for r in lineage["rounds"] for m in r)
    assert [m["hyperparameters"]["lr"] for m in lineage["rounds"][-1]] == LRS


def test_a_killed_pbt_run_resumes_with_the_whole_population_and_ends_as_an_unkilled_one(
    tmp_path, whole_run
):
    config = write_config(tmp_path / "pbt.json")
    killed = run_cli(config, tmp_path / "run", kill=True)
    assert killed.returncode == -9, killed.stdout + killed.stderr  # SIGKILL in round 3
    state = json.loads((tmp_path / "run" / "pbt_state.json").read_text())
    assert state["completed_rounds"] == 2, state["completed_rounds"]
    assert sorted(state["members"]) == [f"member-{i}" for i in range(MEMBERS)]
    assert not (tmp_path / "run" / "result.json").exists()
    resumed = run_cli(config, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (
        "pbt: resuming 4 members from checkpoints/round-0002 (2 of 5 rounds done; round 3 next)"
        in resumed.stdout
    )
    lineage = check_lineage(tmp_path / "run")
    whole, done = whole_run  # the same configuration, never killed
    assert done.returncode == 0, done.stdout + done.stderr
    assert lineage == json.loads((whole / "lineage.json").read_text())
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["round-0005"]


def test_a_run_directory_of_another_configuration_is_refused(tmp_path):
    from tensorfleet.patterns.pbt import run_pbt

    run_pbt(load_config(write_config(tmp_path / "a.json", rounds=1)), tmp_path / "run")
    other = run_cli(write_config(tmp_path / "b.json", rounds=1, seed=4), tmp_path / "run")
    assert other.returncode == 2, other.stdout + other.stderr
    assert "holds a PBT run of another configuration (differs in seed: was seed=3)" in other.stderr


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"members": 1}, "members must be an integer >= 2"),
        ({"hyperparameters": {"lr": [0.1, 0.2]}}, "has 2 values for 4 members"),
        ({"hyperparameters": {"lr": {"low": 0, "high": 1}}}, "a log-scale range needs low > 0"),
        ({"hyperparameters": {"lr": {"values": LRS, "step": 2}}}, "unknown field(s) ['step']"),
        ({"hyperparameters": {"betas": {"values": LRS}}}, "unknown hyperparameter 'betas'"),
        ({"fixed": {"lr": 0.1}}, "'lr' is both searched (hyperparameters) and fixed"),
        ({"exploit_fraction": 0.75}, "exploit_fraction must be in (0, 0.5]"),
        ({"perturb": [0.0]}, "perturb must list positive factors"),
        ({"problem": "no_colon"}, "problem must be 'file.py:factory'"),
        ({"steps": 3}, "unknown setting(s) ['steps']"),
    ],
)
def test_a_wrong_configuration_is_refused_naming_the_field(tmp_path, changes, message):
    path = write_config(tmp_path / "pbt.json", **changes)
    with pytest.raises(PbtConfigError) as caught:
        load_config(path)
    assert message in str(caught.value)


def test_a_missing_problem_factory_is_refused_naming_it(tmp_path):
    config = PopulationConfig(
        problem=f"{PROBLEM}:nothing_here", hyperparameters={"lr": {"values": LRS}}
    )
    with pytest.raises(PbtConfigError, match="has no function 'nothing_here'"):
        config.load_problem()


def test_a_missing_problem_file_says_where_it_looked_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = PopulationConfig(problem="no_such.py:make", hyperparameters={"lr": {"values": LRS}})
    with pytest.raises(PbtConfigError) as caught:
        config.load_problem()
    message = str(caught.value)
    assert str(tmp_path.resolve() / "no_such.py") in message, message
    assert f"relative to {str(tmp_path.resolve())!r}" in message and "fix:" in message, message
    from tensorfleet.patterns.pbt import run_pbt

    with pytest.raises(PbtConfigError, match="no_such.py"):  # refused before its directory
        run_pbt(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_pbt_example_runs(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "pbt_schedule.py"), "--dir", str(tmp_path),
         "--rounds", "3", "--steps-per-round", "5"],
        capture_output=True, text=True, timeout=200,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["exploits"] == 2 and summary["best_hyperparameters"]["lr"] > 0, summary
    assert (tmp_path / "lineage.png").exists() and (tmp_path / "lineage.csv").exists()


def _test_problem(**options: int):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pbt_problem_for_tests", PROBLEM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_problem(seed=3, **options)


class _FailingProblem:
    """The test problem, whose member 1 raises at its step ``at``."""

    def __init__(self, at: int) -> None:
        self.inner, self.at = _test_problem(), at

    def build_model(self, member):
        return self.inner.build_model(member)

    def loss(self, model, step, member):
        if (member, step) == (1, self.at):
            raise RuntimeError(f"member 1 broke at step {step}")
        return self.inner.loss(model, step, member)

    def evaluate(self, model):
        return self.inner.evaluate(model)


def test_a_failed_member_step_ends_the_run_and_the_same_run_resumes_in_process(tmp_path, capsys):
    config = load_config(write_config(tmp_path / "pbt.json"))
    from tensorfleet.patterns.pbt import run_pbt

    with pytest.raises(RuntimeError, match="member 1 broke at step 9"):
        run_pbt(config, tmp_path / "run", _FailingProblem(at=STEPS + 3))  # in round 2
    assert "pbt round 2/5: member-1 failed: RuntimeError('member 1 broke at step 9')" in (
        capsys.readouterr().err
    )
    state = json.loads((tmp_path / "run" / "pbt_state.json").read_text())
    assert state["completed_rounds"] == 1
    result = run_pbt(config, tmp_path / "run", _test_problem())
    assert result.resumed_from_round == 1 and sorted(result.scores) == [
        f"member-{i}" for i in range(MEMBERS)
    ]
    check_lineage(tmp_path / "run")
