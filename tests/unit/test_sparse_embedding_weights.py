"""``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` weights trained through
real ps shards (in threads) are held as rows and pushed as rows, and equal torch's own
optimizers on the same sparse gradients bit for bit (``torch.equal``), on one shard and on a
table split over three: SGD, Adagrad and lazy Adam (``SparseAdam``) in async training, and
the mean of two workers' gradients over the union of their rows in sync training. After
every step each worker's whole copy of the weight equals the shards' rows bit for bit; the
checkpoint loads strictly into a fresh model; a shard that restarts without a checkpoint
gets the rows again from the chief's copy.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file as safetensors_load_file
from torch import nn

import tensorfleet as tfl
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.session.checkpoints import CheckpointDirectory
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.worker.ps_updater import PsUpdater
from tensorfleet.worker.timeouts import ClientTimeouts

from .service_harness import RunningService, serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(90)
SECRET = b"sparse-embedding-weights-unit-secret-000"
TIMEOUTS = ClientTimeouts(connect_s=10.0, initialize_s=20.0, step_s=20.0, recover_s=30.0)
ROWS, DIM, BATCH, STEPS = 37, 4, 12, 6
WEIGHTS = ("emb.weight", "bag.weight")


class Net(nn.Module):
    """Two sparse embeddings (one looked up per id, one summed over a bag) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=True)
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.emb(ids[:, 0]), self.bag(ids)], dim=1)).squeeze(-1)


def _batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + worker)
    ids = torch.randint(0, ROWS, (BATCH, 3), generator=generator)  # ids repeat: coalesced
    return ids, (ids[:, 0] % 3).float()


def _gradients(model: Net, step: int, worker: int) -> dict[str, torch.Tensor]:
    """Backward on this worker's batch; the coalesced sparse gradients of the weights (what
    the worker pushes: duplicate ids summed once)."""
    model.zero_grad(set_to_none=True)
    ids, target = _batch(step, worker)
    F.mse_loss(model(ids), target).backward()
    params = dict(model.named_parameters())
    return {name: params[name].grad.detach().coalesce().clone() for name in WEIGHTS}


def _updater(
    services: list[RunningService],
    model: Net,
    task: str,
    rule: UpdateRule,
    sparse_rule: SparseRowRule | None,
    mode: str = "async",
) -> PsUpdater:
    specs = [
        VariableSpec(n, tuple(p.shape), dtype_name(p.dtype), p.element_size())
        for n, p in model.named_parameters()
    ]
    return PsUpdater(
        [s.address for s in services],
        SECRET,
        task,
        is_chief=task == "worker:0",
        plan=plan_placement(specs, len(services)),
        discipline=UpdateDiscipline(mode=mode),
        timeouts=TIMEOUTS,
        sparse_rule=sparse_rule,
    )


def _start(updater: PsUpdater, model: Net, rule: UpdateRule) -> None:
    updater.connect()
    updater.wrap(model)
    updater.register(list(model.named_parameters()), rule)
    updater.restore(None)
    updater.pull()


def _ps_rows(services: list[RunningService], name: str) -> torch.Tensor:
    """The weight as the shards hold it (every row from the shard that holds it)."""
    stores = [s.service.tables.tables.store(name) for s in services]
    weight = torch.full((ROWS, DIM), float("nan"))
    for store in stores:
        ids = store.created_rows()
        weight[ids] = store.pull(ids)
    return weight


@pytest.fixture
def shards() -> Iterator[Callable[..., list[RunningService]]]:
    started: list[RunningService] = []

    def start(count: int, workers: tuple[str, ...] = ("worker:0",)) -> list[RunningService]:
        for i in range(count):
            config = ServiceConfig(i, workers, idle_timeout_s=60.0, liveness_timeout_s=60.0)
            started.append(serve_in_thread(config, SECRET))
        return started

    try:
        yield start
    finally:
        stop_services(started)


RULES = {
    "sgd": (tfl.optim.SGD(lr=0.1), None, lambda p: torch.optim.SGD(p, lr=0.1)),
    "adagrad": (tfl.optim.Adagrad(lr=0.3), None, lambda p: torch.optim.Adagrad(p, lr=0.3)),
    "sparse_adam": (
        tfl.optim.Adam(lr=0.01),
        tfl.optim.SparseAdam(lr=0.05),
        lambda p: torch.optim.SparseAdam(p, lr=0.05),
    ),
}


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_async_rows_equal_torchs_optimizer_bit_for_bit(shards, num_shards, rule_name, tmp_path):
    rule, sparse_rule, torch_optimizer = RULES[rule_name]
    services = shards(num_shards)
    torch.manual_seed(0)
    model = Net()
    reference = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    optimizers = {n: torch_optimizer([reference[n]]) for n in WEIGHTS}
    updater = _updater(services, model, "worker:0", rule, sparse_rule)
    try:
        _start(updater, model, rule)
        assert updater.mirrored is not None and updater.mirrored.names == set(WEIGHTS)
        assert {p.variable.name for s in updater.plan.shards for p in s} == {
            "head.weight",
            "head.bias",
        }  # the sparse weights are rows, not dense variables
        params = dict(model.named_parameters())
        for step in range(STEPS):
            gradients = _gradients(model, step, 0)
            updater.exchange(step, None)
            for name in WEIGHTS:
                reference[name].grad = gradients[name]
                optimizers[name].step()
                assert torch.equal(params[name].detach(), reference[name].detach()), (step, name)
                assert torch.equal(_ps_rows(services, name), params[name].detach()), (step, name)
        assert not torch.equal(params["emb.weight"], model.emb.weight.new_zeros(1))  # trained
        saved = updater.save()
        directory = CheckpointDirectory(tmp_path / "checkpoints")
        path = directory.write(saved.global_step, list(saved.documents), saved.placement, {})
    finally:
        updater.close()
    fresh = Net()
    state = tfl.load_checkpoint(path, fresh)  # strict: every parameter, whole
    for name in WEIGHTS:
        assert torch.equal(state[name], reference[name].detach())
        assert torch.equal(dict(fresh.named_parameters())[name].detach(), reference[name].detach())
    assert saved.placement["table/emb.weight"]["param"] == "emb.weight"
    exported = safetensors_load_file(tfl.export_checkpoint(path, tmp_path / "model.safetensors"))
    assert set(exported) == set(state) and torch.equal(exported["bag.weight"], state["bag.weight"])


def test_sync_mean_of_two_workers_equals_torch_on_the_mean_sparse_gradient(shards):
    """Two sync workers over 2 shards: each step the shards apply the mean of the workers'
    rows over the union of their rows (a row one worker did not touch counts as zero): the
    weights equal torch's Adagrad given the mean sparse gradient, and both workers' copies
    equal the shards' rows after every step."""
    workers = ("worker:0", "worker:1")
    services = shards(2, workers)
    rule = tfl.optim.Adagrad(lr=0.3)
    torch.manual_seed(1)
    models = [Net(), None]
    models[1] = copy.deepcopy(models[0])
    reference = {
        n: p.detach().clone().requires_grad_(True) for n, p in models[0].named_parameters()
    }
    optimizers = {n: torch.optim.Adagrad([reference[n]], lr=0.3) for n in WEIGHTS}
    updaters = [
        _updater(services, m, w, rule, None, "sync") for m, w in zip(models, workers, strict=True)
    ]
    try:
        _in_threads(
            [lambda u=u, m=m: _start(u, m, rule) for u, m in zip(updaters, models, strict=True)]
        )
        for step in range(STEPS):
            grads = [_gradients(models[k], step, k) for k in range(2)]
            _in_threads([lambda u=u, s=step: u.exchange(s, None) for u in updaters])
            for name in WEIGHTS:
                reference[name].grad = (grads[0][name] + grads[1][name]).coalesce() / 2
                optimizers[name].step()
                rows = _ps_rows(services, name)
                assert torch.equal(rows, reference[name].detach()), (step, name)
                for model in models:
                    assert torch.equal(dict(model.named_parameters())[name].detach(), rows)
    finally:
        for updater in updaters:
            updater.close()


def test_a_shard_restarted_without_a_checkpoint_gets_the_rows_again_from_the_chief(shards):
    """ps:1 restarts empty between two steps. The chief's next push of rows fails there: it
    recovers (ps:1 takes the table again from the chief's copy, then its variables), does
    not send those rows again, and its copy equals the shards' rows after the step."""
    services = shards(2)
    rule = tfl.optim.SGD(lr=0.1)
    torch.manual_seed(2)
    model = Net()
    updater = _updater(services, model, "worker:0", rule, None)
    try:
        _start(updater, model, rule)
        for step in range(2):
            _gradients(model, step, 0)
            updater.exchange(step, None)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        stop_services([services[1]])
        services[1] = serve_in_thread(
            ServiceConfig(1, ("worker:0",), idle_timeout_s=60.0), SECRET, services[1].address
        )
        _gradients(model, 2, 0)
        updater.exchange(2, None)  # the rows' push fails on the new ps:1: recovered
        assert updater.mirrored.source.dropped_pushes == 1
        for name in WEIGHTS:
            rows = _ps_rows(services, name)
            assert torch.equal(rows, dict(model.named_parameters())[name].detach())
        # ps:1's rows (odd ids) came back as the chief held them, without the dropped push
        # (the first weight's: the second's went to the recovered ps:1 and was applied there)
        odd = torch.arange(1, ROWS, 2)
        assert torch.equal(_ps_rows(services, "emb.weight")[odd], before["emb.weight"][odd])
        _gradients(model, 3, 0)
        assert not updater.exchange(3, None).dropped  # and training goes on
        for name in WEIGHTS:
            rows = _ps_rows(services, name)
            assert torch.equal(rows, dict(model.named_parameters())[name].detach())
    finally:
        updater.close()


class _Checkpoints:
    """A checkpoint source holding one saved state (what a session's directory gives)."""

    def __init__(self, global_step: int, documents: list[bytes]) -> None:
        self.checkpoint = SimpleNamespace(path="step", global_step=global_step, documents=documents)

    def newest(self) -> SimpleNamespace:
        return self.checkpoint

    def restoring(self, checkpoint: SimpleNamespace) -> None:
        pass


def test_shards_restored_from_a_checkpoint_continue_exactly(shards):
    """Lazy Adam for the weights, Adam for the head: 2 steps, a checkpoint, then 2 more
    steps on fresh shards restored from it (rows, their moments and step count, the head's
    Adam state) equal 4 uninterrupted steps bit for bit; the chief sends no row at the
    restore (the table is complete) and pulls every row (another incarnation)."""
    rule, sparse_rule = tfl.optim.Adam(lr=0.01), tfl.optim.SparseAdam(lr=0.05)
    first = shards(2)
    torch.manual_seed(3)
    model = Net()
    initial = copy.deepcopy(model.state_dict())
    updater = _updater(first, model, "worker:0", rule, sparse_rule)
    try:
        _start(updater, model, rule)
        for step in range(4):
            _gradients(model, step, 0)
            updater.exchange(step, None)
            if step == 1:
                saved = updater.save()
        uninterrupted = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        updater.close()
    stop_services(first)
    first.clear()
    second = shards(2)
    resumed = Net()
    resumed.load_state_dict(initial)  # a fresh start: the checkpoint must bring the values
    updater = _updater(second, resumed, "worker:0", rule, sparse_rule)
    fills: list[int] = []
    try:
        updater.connect()
        updater.wrap(resumed)
        updater.register(list(resumed.named_parameters()), rule)
        sent = updater.mirrored.source.fill_rows
        updater.mirrored.source.fill_rows = lambda *a, **k: fills.append(1) or sent(*a, **k)
        updater.restore(_Checkpoints(saved.global_step, [bytes(d) for d in saved.documents]))
        updater.pull()
        assert fills == []
        for step in range(2, 4):
            _gradients(resumed, step, 0)
            updater.exchange(step, None)
        for name, param in resumed.named_parameters():
            assert torch.equal(param.detach(), uninterrupted[name]), name
        for name in WEIGHTS:
            assert torch.equal(_ps_rows(second, name), uninterrupted[name])
    finally:
        updater.close()


def _in_threads(calls: list[Callable[[], object]]) -> None:
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60.0)
    assert not any(t.is_alive() for t in threads), "a worker did not finish its call"
    if errors:
        raise errors[0]
