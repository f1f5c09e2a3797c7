"""Population-based training (PBT) on a ps task: :func:`run_pbt`, and ``tensorfleet pbt CONFIG``.

The members of a population train at once, each in its own model namespace on one shared ps
task (:mod:`tensorfleet.ps.model_router`), each pushed by its own worker client in a thread
of this process. Every ``steps_per_round`` steps the driver ranks them by their problem's
score, and the worst ``exploit_fraction`` of them **exploit** one of the best as many: the
ps copies the source's variables *and optimizer state* onto the target's namespace in one
operation (``copy_model``, :mod:`tensorfleet.ps.namespace_copy`), atomic and bit-exact, whose
reply names the source's version (its update count at the copy); then each target
**explores**: its searched hyperparameters become the source's times a factor of
``perturb``, set on the ps (``set_hyperparameters``: the update rule takes them at its next
update, keeping its optimizer state). The members wait between rounds, so a member's copy
is never pushed to while it is made.

The run directory holds:

* ``pbt_state.json``: the rounds done, each member's hyperparameters and global step, the
  lineage so far, and which checkpoint holds the population (written after each round,
  atomically, once that round's checkpoint is complete);
* ``checkpoints/round-NNNN/<member>.safetensors``: each member's ps state (values, optimizer
  state, global step) after round NNNN's exploit and explore: the ps's own ``save`` document;
* ``lineage.json``, ``lineage.csv``, ``lineage.png`` (:mod:`tensorfleet.patterns.pbt_lineage`)
  and ``result.json`` (each member's final score and hyperparameters, the best member).

**Resume**: running the same configuration on the same directory again (after a kill, at
any point) starts every member from the newest complete round's checkpoint, with the
hyperparameters and lineage of that round: the same population, no member lost, and the
rounds after it run again. A configuration that differs in anything but ``rounds`` is
refused, naming the difference. ``exploit: false`` runs the same members without exploit
and explore: the fixed-hyperparameter baseline at the same budget.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import shutil
import socket as sockets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tensorfleet.errors import DeadlineExceeded
from tensorfleet.patterns.pbt_config import PbtConfigError, PbtProblem, PopulationConfig
from tensorfleet.patterns.pbt_lineage import Lineage, MemberRound, best, write_json
from tensorfleet.ps.model_namespace import ModelClaim, fingerprint
from tensorfleet.ps.model_router import ModelRouter
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service_settings import ServiceConfig
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.wire.service_socket import ServiceSocket
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.namespace_control import NamespaceControl
from tensorfleet.worker.timeouts import ClientTimeouts

log = logging.getLogger("tensorfleet.pbt")

STATE_FILE = "pbt_state.json"
RESULT_FILE = "result.json"
CHECKPOINTS = "checkpoints"


@dataclass
class PbtResult:
    """What a PBT run ended with."""

    best_member: str
    best_score: float
    best_hyperparameters: dict[str, float]
    scores: dict[str, float]
    """Each member's score after the last round."""
    lineage: Lineage
    directory: Path
    resumed_from_round: int | None
    """The round whose checkpoint this run started from (None: it started fresh)."""


class _Member:
    """One member: its model, its worker client on the ps, its hyperparameters."""

    def __init__(
        self, index: int, model: nn.Module, address: str, secret: bytes, timeouts: ClientTimeouts
    ) -> None:
        self.index = index
        self.name = f"member-{index}"
        self.model = model
        self.task = f"worker:{index}"
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        variables = [
            (n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in self.named
        ]
        digest, summary = fingerprint(variables)
        claim = ModelClaim(self.name, (self.task,), digest, summary)
        self.client = ParameterClient([address], secret, self.task, timeouts, model=claim)
        self.plan = plan_placement(
            [VariableSpec(n, tuple(p.shape), d, p.element_size()) for (n, p), (_, _, d) in
             zip(self.named, variables, strict=True)],
            1,
        )  # fmt: skip
        self.global_step = 0
        self.hyperparameters: dict[str, float] = {}


def run_pbt(
    config: PopulationConfig, directory: str | Path, problem: PbtProblem | None = None
) -> PbtResult:
    """Run (or resume) the PBT of ``config`` in ``directory``; see the module docstring.

    ``problem``: the members' problem (default: ``config.problem``'s factory). Raises
    PbtConfigError for a configuration refused before anything ran, and the error of a
    member's step or of the ps otherwise (the run then resumes from its last round)."""
    config.validate()
    directory = Path(directory)
    state = _read_state(directory, config)
    problem = problem if problem is not None else config.load_problem()
    directory.mkdir(parents=True, exist_ok=True)  # after every refusal: none leaves a directory
    secret = secrets.token_bytes(32)
    address = f"127.0.0.1:{_loopback_port()}"
    workers = tuple(f"worker:{i}" for i in range(config.members))
    ps_config = ServiceConfig(
        0,
        workers,
        idle_timeout_s=config.round_timeout_s + 60.0,
        end_grace_s=5.0,
        liveness_timeout_s=config.round_timeout_s + 60.0,
    )
    socket = ServiceSocket(address, secret, ps_config.limits)
    router = ModelRouter(socket, ps_config)
    stop = threading.Event()
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            router.serve(stop)
        except BaseException as exc:  # raised in the driver's thread below
            failure.append(exc)

    ps_thread = threading.Thread(target=serve, name="pbt-ps", daemon=True)
    ps_thread.start()
    timeouts = ClientTimeouts(
        connect_s=60.0, initialize_s=60.0, step_s=min(600.0, config.round_timeout_s)
    )
    members: list[_Member] = []
    control: NamespaceControl | None = None
    try:
        for i in range(config.members):
            members.append(_Member(i, problem.build_model(i), address, secret, timeouts))
        lineage, first_round = _start_members(config, directory, state, members)
        control = NamespaceControl([address], secret, timeout_s=60.0)
        for round_index in range(first_round, config.rounds):
            _train_round(config, problem, members, round_index, failure)
            records = _exploit_and_explore(config, problem, members, control, round_index)
            lineage.rounds.append(records)
            _checkpoint(config, directory, members, lineage, round_index)
            best_now = best(records)
            print(
                f"pbt round {round_index + 1}/{config.rounds}: best {best_now.member} score "
                f"{best_now.score:.6g} {_describe(best_now.hyperparameters)}; "
                f"{sum(r.copied_from is not None for r in records)} exploit(s)",
                flush=True,
            )
        return _finish(config, directory, lineage, state)
    finally:
        if control is not None:
            control.close()
        for member in members:
            member.client.close()
        stop.set()
        ps_thread.join(10.0)
        socket.close()


def _start_members(
    config: PopulationConfig, directory: Path, state: dict[str, Any] | None, members: list[_Member]
) -> tuple[Lineage, int]:
    """Connect every member and create its variables: fresh, or from the state's checkpoint."""
    initial = config.initial_hyperparameters()
    lineage = Lineage([m.name for m in members])
    first_round = 0
    if state is not None:
        lineage = Lineage.from_json(state["lineage"])
        first_round = int(state["completed_rounds"])
    for member in members:
        member.client.connect()
        resume = None
        if state is not None:
            saved = state["members"][member.name]
            member.hyperparameters = dict(saved["hyperparameters"])
            document = (directory / state["checkpoint"] / f"{member.name}.safetensors").read_bytes()
            resume = (int(saved["global_step"]), [document])
        else:
            member.hyperparameters = dict(initial[member.index])
        member.global_step = member.client.register(
            member.named,
            member.plan,
            config.rule_for(member.hyperparameters),
            is_chief=True,
            discipline=UpdateDiscipline(),
            resume=resume,
        )
        if resume is not None:
            member.client.pull()  # the model takes the checkpoint's values
            member.global_step = resume[0]
    if state is not None:
        print(
            f"pbt: resuming {len(members)} members from {state['checkpoint']} ({first_round} "
            f"of {config.rounds} rounds done; round {first_round + 1} next)",
            flush=True,
        )
    return lineage, first_round


def _train_round(
    config: PopulationConfig,
    problem: PbtProblem,
    members: list[_Member],
    round_index: int,
    failure: list[BaseException],
) -> None:
    """Every member trains ``steps_per_round`` steps, all at once (one thread each)."""

    def train(member: _Member) -> None:
        for _ in range(config.steps_per_round):
            for _, p in member.named:
                p.grad = None
            loss = problem.loss(member.model, member.global_step, member.index)
            loss.backward()
            progress = member.client.push_pull()
            member.global_step = progress.global_step

    deadline = time.monotonic() + config.round_timeout_s
    pool = ThreadPoolExecutor(len(members), thread_name_prefix="pbt-member")
    finished = False
    try:
        futures = {member.name: pool.submit(train, member) for member in members}
        for name, future in futures.items():
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise DeadlineExceeded(
                    f"pbt round {round_index + 1}/{config.rounds}: {name} did not finish its "
                    f"{config.steps_per_round} steps within round_timeout_s="
                    f"{config.round_timeout_s:g} s; raise round_timeout_s or lower "
                    "steps_per_round"
                ) from None
            except BaseException as exc:  # say which member's step failed, keep the error
                print(
                    f"pbt round {round_index + 1}/{config.rounds}: {name} failed: {exc!r}",
                    file=sys.stderr,
                )
                raise
        finished = True
    finally:
        # A failed round does not wait for the other members (their pushes have deadlines
        # of their own; the clients are closed next).
        pool.shutdown(wait=finished, cancel_futures=True)
    if failure:
        raise failure[0]


def _exploit_and_explore(
    config: PopulationConfig,
    problem: PbtProblem,
    members: list[_Member],
    control: NamespaceControl,
    round_index: int,
) -> list[MemberRound]:
    """Rank the members; the worst copy the best and perturb the copied hyperparameters."""
    with torch.no_grad():
        scores = {m.name: float(problem.evaluate(m.model)) for m in members}
    records = {
        m.name: MemberRound(
            round_index, m.name, m.global_step, scores[m.name], dict(m.hyperparameters)
        )
        for m in members
    }
    if not config.exploit or round_index == config.rounds - 1:
        return list(records.values())
    rng = random.Random(config.seed * 1_000_003 + round_index)
    ranked = sorted(members, key=lambda m: (_rank_key(scores[m.name]), m.index))
    count = max(1, int(len(members) * config.exploit_fraction))
    top, bottom = ranked[:count], ranked[-count:]
    for target in bottom:
        source = rng.choice(top)
        copied = control.copy_model(source.name, target.name)
        explored = {
            name: config.hyperparameters[name].clip(value * rng.choice(config.perturb))
            for name, value in source.hyperparameters.items()
        }
        control.set_hyperparameters(target.name, explored)
        target.hyperparameters = explored
        target.client.pull()  # the target's model takes the copied values
        record = records[target.name]
        record.hyperparameters = dict(explored)
        record.copied_from = source.name
        record.source_version = copied.source_versions[0]
        record.source_global_step = copied.source_global_step
        record.source_score = scores[source.name]
    return list(records.values())


def _rank_key(score: float) -> float:
    """Lower is better; a NaN (a diverged member) ranks last."""
    return float("inf") if score != score else score


def _checkpoint(
    config: PopulationConfig,
    directory: Path,
    members: list[_Member],
    lineage: Lineage,
    round_index: int,
) -> None:
    """Save every member's ps state for ``round_index``, then the state that points to it,
    then drop the previous round's checkpoint (a kill at any point leaves one complete)."""
    relative = f"{CHECKPOINTS}/round-{round_index + 1:04d}"
    target = directory / relative
    if target.exists():
        shutil.rmtree(target)
    partial = directory / f"{relative}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    steps = {}
    for member in members:
        steps[member.name], documents = member.client.save()
        (partial / f"{member.name}.safetensors").write_bytes(bytes(documents[0]))
    partial.rename(target)
    write_json(
        directory / STATE_FILE,
        {
            "config": config.identity(),
            "completed_rounds": round_index + 1,
            "checkpoint": relative,
            "members": {
                m.name: {"global_step": steps[m.name], "hyperparameters": m.hyperparameters}
                for m in members
            },
            "lineage": lineage.to_json(),
        },
    )
    for old in (directory / CHECKPOINTS).iterdir():
        if old.name != target.name:
            shutil.rmtree(old)


def _read_state(directory: Path, config: PopulationConfig) -> dict[str, Any] | None:
    """The state of an earlier run in ``directory`` (None: none), checked against ``config``."""
    path = directory / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PbtConfigError(
            f"{path} cannot be read ({exc}): remove it (and {directory / CHECKPOINTS}) to start "
            "over"
        ) from None
    earlier = state.get("config", {})
    now = config.identity()
    differ = sorted(k for k in set(earlier) | set(now) if earlier.get(k) != now.get(k))
    if differ:
        raise PbtConfigError(
            f"{directory} holds a PBT run of another configuration (differs in "
            f"{', '.join(differ)}: was {', '.join(f'{k}={earlier.get(k)!r}' for k in differ)}): "
            "resume it with its own configuration, or use another directory"
        )
    if int(state["completed_rounds"]) > config.rounds:
        raise PbtConfigError(
            f"{directory} holds {state['completed_rounds']} rounds already, more than rounds="
            f"{config.rounds}: ask for at least as many"
        )
    return state


def _finish(
    config: PopulationConfig, directory: Path, lineage: Lineage, state: dict[str, Any] | None
) -> PbtResult:
    paths = lineage.write(directory)
    last = lineage.rounds[-1]
    winner = best(last)
    result = PbtResult(
        winner.member,
        winner.score,
        dict(winner.hyperparameters),
        {m.member: m.score for m in last},
        lineage,
        directory,
        None if state is None else int(state["completed_rounds"]),
    )
    write_json(
        directory / RESULT_FILE,
        {
            "name": config.name,
            "best_member": result.best_member,
            "best_score": result.best_score,
            "best_hyperparameters": result.best_hyperparameters,
            "scores": result.scores,
            "exploits": len(lineage.exploits()),
            "rounds": len(lineage.rounds),
            "exploit": config.exploit,
            "files": {k: None if v is None else v.name for k, v in paths.items()},
        },
    )
    return result


def _loopback_port() -> int:
    """A TCP port free on loopback now, for the run's own ps task (the kernel's pick)."""
    with sockets.socket(sockets.AF_INET, sockets.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _describe(hyperparameters: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in sorted(hyperparameters.items()))
