"""In-graph replication: 2 CPU replicas give the gradients of one replica on the whole batch."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorfleet.parallel.errors import ParallelConfigError, ReplicaFailed
from tensorfleet.parallel.replicas import InGraphReplicas
from tests.backward_threads import record_backward_threads


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5)
    )


def cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)
    )


def ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def reference_grads(model: nn.Module, loss_fn, *batch) -> tuple[float, list[torch.Tensor]]:
    ref = copy.deepcopy(model)
    loss = loss_fn(ref, *batch)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in ref.parameters()]


@pytest.mark.parametrize(
    ("make", "shape", "classes", "batch"),
    [(mlp, (20,), 5, 64), (mlp, (20,), 5, 7), (cnn, (1, 8, 8), 3, 32)],
    ids=["mlp", "mlp-uneven-batch", "cnn"],
)
@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_match_one_replica_on_the_whole_batch(make, shape, classes, batch, replicas):
    torch.manual_seed(2)
    x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    model = make()
    loss_ref, grads_ref = reference_grads(model, ce, x, y)
    with InGraphReplicas(model, [f"/cpu:{i}" for i in range(replicas)]) as engine:
        for _ in range(2):  # twice: the second step replaces the first's gradients
            loss = engine.step(ce, x, y)
    assert abs(loss.item() - loss_ref) < 1e-5
    for (name, p), g in zip(model.named_parameters(), grads_ref, strict=True):
        assert (p.grad - g).abs().max().item() < 1e-5, name


def test_sum_reduction_adds_the_replicas_gradients():
    torch.manual_seed(3)
    x, y = torch.randn(10, 20), torch.randint(0, 5, (10,))
    model = mlp()

    def ce_sum(m, x, y):
        return F.cross_entropy(m(x), y, reduction="sum")

    loss_ref, grads_ref = reference_grads(model, ce_sum, x, y)
    with InGraphReplicas(model, 2, loss_reduction="sum") as engine:
        loss = engine.step(ce_sum, x, y)
    assert abs(loss.item() - loss_ref) < 1e-4
    for p, g in zip(model.parameters(), grads_ref, strict=True):
        assert (p.grad - g).abs().max().item() < 1e-5


def test_replicas_follow_the_master_after_an_update():
    torch.manual_seed(4)
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    model, ref = mlp(), mlp()
    opt, opt_ref = (
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(ref.parameters(), lr=0.1),
    )
    with InGraphReplicas(model, 2) as engine:
        for _ in range(5):
            engine.step(ce, x, y)
            opt.step()
            opt_ref.zero_grad()
            ce(ref, x, y).backward()
            opt_ref.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert (p - q).abs().max().item() < 1e-5


def test_batchnorm_running_stats_are_the_weighted_mean():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    x = torch.randn(8, 4)
    with InGraphReplicas(model, 2) as engine:
        engine.step(lambda m, x: m(x).pow(2).mean(), x)
        expected = sum(0.5 * r[1].running_mean for r in engine.replicas)
    assert torch.allclose(model[1].running_mean, expected)
    assert model[1].num_batches_tracked.item() == 1


def test_thread_budget_is_divided_and_restored():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with InGraphReplicas(mlp(), 2):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_bad_input_is_named():
    model = mlp()
    with pytest.raises(ParallelConfigError, match="at least one device"):
        InGraphReplicas(model, [])
    with pytest.raises(ParallelConfigError, match="loss_reduction must be one of"):
        InGraphReplicas(model, 2, loss_reduction="avg")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"asks for a GPU.*devices present: /device:CPU:0"):
            InGraphReplicas(model, ["/gpu:0", "/gpu:1"])
    with InGraphReplicas(model, 3) as engine:
        with pytest.raises(ParallelConfigError, match="a batch of 2 cannot feed 3 replicas"):
            engine.step(ce, torch.randn(2, 20), torch.zeros(2, dtype=torch.long))
        with pytest.raises(ParallelConfigError, match="differ in their first dimension"):
            engine.step(ce, torch.randn(6, 20), torch.zeros(5, dtype=torch.long))
        with pytest.raises(
            ReplicaFailed, match=r"replica 0 on /device:CPU:0 failed .*mat1 and mat2"
        ):
            engine.step(ce, torch.randn(6, 3), torch.zeros(6, dtype=torch.long))
        with pytest.raises(ReplicaFailed, match="loss_fn must return a scalar tensor"):
            engine.step(lambda m, x: m(x), torch.randn(6, 20))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_replicas_match():  # pragma: no cover - GPU machines only
    torch.manual_seed(6)
    x, y = torch.randn(32, 20), torch.randint(0, 5, (32,))
    model = mlp().cuda(0)
    loss_ref, grads_ref = reference_grads(model, ce, x.cuda(0), y.cuda(0))
    with InGraphReplicas(model, ["/gpu:0", "/gpu:1"]) as engine:
        engine.step(ce, x, y)
    for p, g in zip(model.parameters(), grads_ref, strict=True):
        assert (p.grad - g).abs().max().item() < 1e-5


@pytest.mark.parametrize("replicas", [2, 3])
def test_replicated_module_in_a_step_closure_matches_one_replica(replicas):
    """The closure API: loss on the wrapper's output, loss.backward() -> the master's grads."""
    from tensorfleet.parallel.replicas import ReplicatedModule

    torch.manual_seed(7)
    x, y = torch.randn(9, 1, 8, 8), torch.randint(0, 3, (9,))
    model = cnn()
    loss_ref, grads_ref = reference_grads(model, ce, x, y)
    x_grad_model = copy.deepcopy(model)
    with InGraphReplicas(model, replicas) as engine:
        wrapper = ReplicatedModule(engine)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(wrapper(x), y)
            loss.backward()
        assert abs(loss.item() - loss_ref) < 1e-5
        for (name, p), g in zip(model.named_parameters(), grads_ref, strict=True):
            assert (p.grad - g).abs().max().item() < 1e-5, name
        # gradients reach a differentiable input too
        xr = x.clone().requires_grad_(True)
        F.cross_entropy(wrapper(xr), y).backward()
        xq = x.clone().requires_grad_(True)
        F.cross_entropy(x_grad_model(xq), y).backward()
        assert (xr.grad - xq.grad).abs().max().item() < 1e-5
        with torch.no_grad():
            assert torch.allclose(wrapper(x), model(x))
    assert [n for n, _ in wrapper.named_parameters()] == [
        f"module.{n}" for n, _ in model.named_parameters()
    ]


@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_on_the_device_of_the_loss_run_their_backward_in_autograds_own_thread(
    monkeypatch, replicas
):
    """On a GPU autograd runs the wrapper's backward on that device's one thread, so a replica
    on the same device must run its backward there: queued from a replica thread it would
    wait for that thread forever (two replicas on one H200 hung). The CPU stands in for the
    GPU: the wrapper is told its backward runs on the CPU's device thread."""
    from tensorfleet.parallel import replicas as replicas_module
    from tensorfleet.parallel.replicas import ReplicatedModule

    torch.manual_seed(8)
    x, y = torch.randn(9, 1, 8, 8), torch.randint(0, 3, (9,))
    model = cnn()
    loss_ref, grads_ref = reference_grads(model, ce, x, y)
    with InGraphReplicas(model, replicas) as engine:
        wrapper = ReplicatedModule(engine)
        in_pool = record_backward_threads(engine.replicas)
        F.cross_entropy(wrapper(x), y).backward()
        assert in_pool and all(name.startswith("replica") for name in in_pool)  # the CPU's way

        monkeypatch.setattr(replicas_module, "backward_thread_device", lambda grad: grad.device)
        in_pool.clear()
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(wrapper(x), y)
        loss.backward()
        assert in_pool and set(in_pool) == {threading.current_thread().name}
        assert abs(loss.item() - loss_ref) < 1e-5
        for (name, p), g in zip(model.named_parameters(), grads_ref, strict=True):
            assert (p.grad - g).abs().max().item() < 1e-5, name


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_replicas_on_one_gpu_in_a_step_closure_match():  # pragma: no cover - GPU only
    """The closure API with both replicas on the GPU of the loss (it hung before)."""
    from tensorfleet.parallel.replicas import ReplicatedModule

    torch.manual_seed(9)
    x, y = torch.randn(32, 20).cuda(), torch.randint(0, 5, (32,)).cuda()
    model = mlp().cuda()
    loss_ref, grads_ref = reference_grads(model, ce, x, y)
    with InGraphReplicas(model, ["/gpu:0", "/gpu:0"]) as engine:
        F.cross_entropy(ReplicatedModule(engine)(x), y).backward()
    for p, g in zip(model.parameters(), grads_ref, strict=True):
        assert (p.grad - g).abs().max().item() < 1e-5
