"""Every updater honours the :class:`~tensorfleet.worker.updater.Updater` protocol alike: the
same method signatures, and the same life (connect, wrap, register, restore, pull, exchange,
skip, agree, save, restore from that save, finish, close) with the same observable results,
for the one-process updater, the parameter-server updater (a real ps shard in a thread) and
the all-reduce updater (a torch.distributed world of one over gloo).

A new update mode adds its updater to ``UPDATERS`` here (docs/architecture.md, "Adding an
update mode")."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from tensorfleet.launch.ports import free_port
from tensorfleet.parallel.engine_updaters import LocalPipelineUpdater, ReplicaUpdater
from tensorfleet.parallel.pipeline_updater import PipelineLeaderUpdater
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import Momentum
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.worker.allreduce_updater import AllReduceUpdater
from tensorfleet.worker.local_updater import LocalUpdater
from tensorfleet.worker.ps_updater import PsUpdater
from tensorfleet.worker.push_overlap import Overlap
from tensorfleet.worker.timeouts import ClientTimeouts
from tensorfleet.worker.updater import SavedState, Updater

from .service_harness import RunningService, serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(60)

SECRET = b"updater-conformance-unit-test-secret-000"
TIMEOUTS = ClientTimeouts(connect_s=10.0, initialize_s=10.0, step_s=10.0)
DATA = {"epoch": 0, "offset": 12}

#: An updater factory: a context manager that yields a fresh updater (and its own ps, if any).
UpdaterFactory = Callable[[list[tuple[str, torch.Tensor]]], AbstractContextManager[Updater]]


@contextmanager
def _local(named_params: list[tuple[str, torch.Tensor]]) -> Iterator[Updater]:
    yield LocalUpdater()


@contextmanager
def _ps(
    named_params: list[tuple[str, torch.Tensor]], overlap: Overlap | None = None
) -> Iterator[Updater]:
    """A fresh (empty) ps shard for one worker, and the chief's updater on it (with
    ``overlap``: its pushes go through the overlapped path, as a session drives it)."""
    service: RunningService = serve_in_thread(
        ServiceConfig(shard_index=0, worker_tasks=("worker:0",)), SECRET
    )
    specs = [
        VariableSpec(name, tuple(p.shape), dtype_name(p.dtype), p.element_size())
        for name, p in named_params
    ]
    try:
        updater = PsUpdater(
            [service.address],
            SECRET,
            "worker:0",
            is_chief=True,
            plan=plan_placement(specs, 1),
            discipline=UpdateDiscipline(mode="async"),
            timeouts=TIMEOUTS,
            overlap=overlap,
        )
        if overlap is not None:
            updater.step_overlap(during_backward=True)
        yield updater
    finally:
        stop_services([service])


@contextmanager
def _ps_overlap(named_params: list[tuple[str, torch.Tensor]]) -> Iterator[Updater]:
    """The ps updater with its overlapped push (buckets, the exchange settled before every
    other operation)."""
    with _ps(named_params, Overlap(bucket_bytes=64)) as updater:
        yield updater


@contextmanager
def _allreduce(named_params: list[tuple[str, torch.Tensor]]) -> Iterator[Updater]:
    yield AllReduceUpdater(f"127.0.0.1:{free_port()}", 0, 1, TIMEOUTS, task_names=["worker:0"])


@contextmanager
def _replicas(named_params: list[tuple[str, torch.Tensor]]) -> Iterator[Updater]:
    """In-graph replication (2 CPU replicas) around the one-process updater."""
    yield ReplicaUpdater(LocalUpdater(), ["/cpu:0", "/cpu:1"])  # type: ignore[misc]


@contextmanager
def _local_pipeline(named_params: list[tuple[str, torch.Tensor]]) -> Iterator[Updater]:
    """A 2-stage pipeline in the task (5 micro-batches of 1) around the ps updater."""
    with _ps(named_params) as inner:
        yield LocalPipelineUpdater(inner, ["/cpu:0", "/cpu:1"], 5)  # type: ignore[misc]


UPDATERS: dict[str, UpdaterFactory] = {
    "local": _local,
    "ps": _ps,
    "ps_overlap": _ps_overlap,
    "allreduce": _allreduce,
    "replicas": _replicas,
    "local_pipeline": _local_pipeline,
}
#: Updater classes whose life needs several processes: their signatures are checked here,
#: their life in tests/cluster (test_engines_exact.py, test_driven_pipeline.py).
SIGNATURE_ONLY = {"pipeline_leader": PipelineLeaderUpdater}


@dataclass(frozen=True)
class _Checkpoint:
    path: Path
    global_step: int
    documents: list[bytes]


class _Source:
    """A checkpoint source holding one saved state; counts the restores it reports."""

    def __init__(self, saved: SavedState | None) -> None:
        self.checkpoint = (
            None
            if saved is None
            else _Checkpoint(Path("step-1"), saved.global_step, [bytes(d) for d in saved.documents])
        )
        self.reported: list[int] = []

    def newest(self) -> _Checkpoint | None:
        return self.checkpoint

    def restoring(self, checkpoint: _Checkpoint) -> None:
        self.reported.append(checkpoint.global_step)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _backward(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 3, generator=generator), torch.randn(5, 2, generator=generator)
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _protocol_methods() -> list[str]:
    return [
        name
        for name, member in vars(Updater).items()
        if callable(member) and not name.startswith("_")
    ]


@pytest.mark.parametrize("kind", [*UPDATERS, *SIGNATURE_ONLY])
def test_every_updater_has_the_protocols_signatures(kind: str) -> None:
    cls = {
        "local": LocalUpdater,
        "ps": PsUpdater,
        "ps_overlap": PsUpdater,
        "allreduce": AllReduceUpdater,
        "replicas": ReplicaUpdater,
        "local_pipeline": LocalPipelineUpdater,
        **SIGNATURE_ONLY,
    }[kind]
    assert _protocol_methods()
    for name in _protocol_methods():
        expected = inspect.signature(getattr(Updater, name))
        got = inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(expected.parameters), f"{cls.__name__}.{name}"
        for parameter in expected.parameters.values():
            if parameter.default is not inspect.Parameter.empty:
                assert got.parameters[parameter.name].default == parameter.default, (
                    f"{cls.__name__}.{name}({parameter.name}=...)"
                )


@pytest.mark.parametrize("kind", UPDATERS)
def test_every_updater_lives_the_same_life(kind: str) -> None:
    factory = UPDATERS[kind]
    model = _model()
    named = list(model.named_parameters())
    initial = _values(model)
    final_checkpoints: list[str] = []
    with factory(named) as updater:
        assert isinstance(updater, Updater)  # every method and attribute is there
        try:
            updater.connect(torch.device("cpu"))
            wrapped = updater.wrap(model)
            updater.register(named, Momentum(0.1, 0.9))
            restored = updater.restore(_Source(None))  # no checkpoint yet: initial values
            assert (restored.global_step, restored.data) == (0, None)
            assert updater.pull().global_step == 0
            assert all(torch.equal(v, initial[n]) for n, v in _values(model).items())

            _backward(wrapped, 1)
            progress = updater.exchange(0, DATA)
            assert progress.global_step == 1 and not progress.stop
            after_one = _values(model)
            assert not torch.equal(after_one["0.weight"], initial["0.weight"])

            _backward(wrapped, 2)
            skipped = updater.skip(1)  # a vetoed update applies nothing from this worker
            assert skipped.global_step == 1
            assert all(torch.equal(v, after_one[n]) for n, v in _values(model).items())

            assert updater.agree(False, False) == (False, False, False)
            assert updater.agree(True, True, True) == (True, True, True)  # a world of one agrees

            saved = updater.save(DATA)
            assert saved is not None and saved.global_step == 1 and len(saved.documents) == 1
            assert {p["param"] for p in saved.placement.values()} == {n for n, _ in named}
            assert isinstance(updater.stats(), list)

            _backward(wrapped, 3)  # a step after the save: the final checkpoint is due (a ps
            assert updater.exchange(1, DATA).global_step == 2  # skips it at the saved step)
        finally:
            updater.finish(lambda: final_checkpoints.append("final"))
            updater.close()
    assert final_checkpoints == ["final"]  # the chief's final checkpoint ran once

    # A fresh updater (and, for ps, a fresh empty shard) restores that save: the values,
    # the global step and this worker's data position come back, reported once.
    model = _model()
    named = list(model.named_parameters())
    source = _Source(saved)
    with factory(named) as updater:
        try:
            updater.connect(torch.device("cpu"))
            updater.wrap(model)
            updater.register(named, Momentum(0.1, 0.9))
            restored = updater.restore(source)
            assert (restored.global_step, restored.data) == (1, DATA)
            assert source.reported == [1]
            assert updater.pull().global_step == 1
            for name, value in _values(model).items():
                assert torch.equal(value, after_one[name]), name
        finally:
            updater.finish(None)
            updater.close()


@pytest.mark.parametrize("kind", UPDATERS)
def test_restore_without_resume_starts_from_the_initial_values(kind: str) -> None:
    model = _model()
    named = list(model.named_parameters())
    initial = _values(model)
    with UPDATERS[kind](named) as updater:
        try:
            updater.connect(torch.device("cpu"))
            updater.wrap(model)
            updater.register(named, Momentum(0.1, 0.9))
            source = _Source(SavedState(7, [b"never read"], {}))
            assert updater.restore(source, resume=False).global_step == 0
            assert source.reported == []
            assert all(torch.equal(v, initial[n]) for n, v in _values(model).items())
        finally:
            updater.finish(None, failed=True)
            updater.close()


@pytest.mark.parametrize("kind", UPDATERS)
def test_retune_applies_the_new_hyperparameters_from_the_next_update_on(kind: str) -> None:
    """The session's schedule (``sess.optimizer``) reaches the rule wherever it runs: the
    update after a retune equals torch's optimizer, given the same gradients, whose learning
    rate was changed between its two steps, bit for bit, with the momentum kept."""
    rule = Momentum(0.1, 0.9)
    model = _model()
    named = list(model.named_parameters())
    reference = [p.detach().clone().requires_grad_(True) for _, p in named]
    optimizer = torch.optim.SGD(reference, **rule.hyperparameters)
    with UPDATERS[kind](named) as updater:
        try:
            updater.connect(torch.device("cpu"))
            wrapped = updater.wrap(model)
            updater.register(named, rule)
            updater.restore(_Source(None))
            updater.pull()
            for step, lr in ((0, 0.1), (1, 0.025)):
                if lr != 0.1:
                    updater.retune({**rule.hyperparameters, "lr": lr})
                _backward(wrapped, step + 1)
                for mine, (_, param) in zip(reference, named, strict=True):
                    mine.grad = param.grad.clone()  # the gradients this updater applies
                optimizer.param_groups[0]["lr"] = lr
                optimizer.step()
                updater.exchange(step, None)
            for mine, (name, param) in zip(reference, named, strict=True):
                assert torch.equal(param.detach(), mine.detach()), name
        finally:
            updater.finish(None)
            updater.close()
