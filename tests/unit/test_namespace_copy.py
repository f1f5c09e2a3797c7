"""``copy_model`` and ``set_hyperparameters`` on a ps task (:mod:`tensorfleet.ps.namespace_copy`)
over the wire, with real clients: the copy is bit-exact (values and Adam's state equal the
source's at the copy's version, and the same gradient then gives the same values), atomic
under a thread pushing to the target meanwhile (the result is the copy followed by some of
the pushes, never a mix), refused with a reason between models that differ; a retune changes
the learning rate from the next update on and keeps the optimizer state."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from tensorfleet.errors import NotInitialized, RequestRefused
from tensorfleet.optim import SGD, Adam
from tensorfleet.ps.model_namespace import ModelClaim, fingerprint
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.namespace_control import NamespaceControl
from tensorfleet.worker.timeouts import ClientTimeouts
from tests.unit.test_model_router import SECRET, WORKERS, RunningRouter, serving_router

pytestmark = pytest.mark.timeout(120)

TIMEOUTS = ClientTimeouts(connect_s=10.0, initialize_s=10.0, step_s=30.0, recover_s=5.0)


@pytest.fixture
def router() -> Iterator[RunningRouter]:
    yield from serving_router()


class Member:
    """The only worker of one model: variables ``w`` and ``b``, initialized from ``seed``."""

    def __init__(
        self,
        address: str,
        index: int,
        rule: UpdateRule,
        seed: int,
        size: int = 1000,
        discipline: UpdateDiscipline | None = None,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(size, generator=generator))
        self.b = torch.nn.Parameter(torch.randn(3, generator=generator))
        self.named = [("w", self.w), ("b", self.b)]
        self.model = f"m{index}"
        digest, summary = fingerprint([("w", (size,), "float32"), ("b", (3,), "float32")])
        task = WORKERS[index]
        claim = ModelClaim(self.model, (task,), digest, summary)
        self.client = ParameterClient([address], SECRET, task, TIMEOUTS, model=claim)
        plan = plan_placement(
            [
                VariableSpec("w", (size,), "float32", 4 * size),
                VariableSpec("b", (3,), "float32", 12),
            ],
            1,
        )
        self.client.connect()
        self.client.register(
            self.named, plan, rule, is_chief=True, discipline=discipline or UpdateDiscipline()
        )

    def step(self, scale: float, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        for p in (self.w, self.b):
            p.grad = scale * torch.randn(p.shape, generator=generator)
        return self.client.push_pull()


def _assert_same_state(a: tuple[dict, dict, int], b: tuple[dict, dict, int]) -> None:
    values_a, optimizer_a, _ = a
    values_b, optimizer_b, _ = b
    assert values_a.keys() == values_b.keys() and optimizer_a.keys() == optimizer_b.keys()
    for name in values_a:
        assert torch.equal(values_a[name], values_b[name]), f"values of {name} differ"
    for name in optimizer_a:
        assert optimizer_a[name].keys() == optimizer_b[name].keys()
        for key in optimizer_a[name]:
            assert torch.equal(optimizer_a[name][key], optimizer_b[name][key]), (
                f"optimizer state {key!r} of {name} differs"
            )


def test_a_copy_is_bit_exact_at_the_sources_version_and_trains_on_identically(router):
    source = Member(router.address, 0, Adam(lr=0.01), seed=1)
    target = Member(router.address, 1, Adam(lr=0.01), seed=2)
    control = NamespaceControl([router.address], SECRET, timeout_s=10.0)
    try:
        for i in range(5):
            source.step(1.0, seed=i)
        for i in range(2):
            target.step(-3.0, seed=10 + i)
        before = router.state(source.model)
        copied = control.copy_model(source.model, target.model)
        assert copied.source_versions == (before[2],) == (5,)
        assert copied.source_global_step == 5
        assert copied.target_versions == (2,)  # the target counts its own updates
        after = router.state(target.model)
        _assert_same_state(after, before)
        _assert_same_state(router.state(source.model), before)  # the source is unchanged
        target.client.pull()
        assert torch.equal(target.w.detach(), source.w.detach())
        # Adam's step counts and moments came along: the same gradient, the same values.
        source.step(0.5, seed=99)
        target.step(0.5, seed=99)
        _assert_same_state(router.state(target.model), router.state(source.model))
        assert torch.equal(target.w.detach(), source.w.detach())
        # The copy does not share memory with the source: the source moves on alone.
        source.step(1.0, seed=7)
        assert not torch.equal(target.w.detach(), source.w.detach())
    finally:
        control.close()
        for member in (source, target):
            member.client.close()


def test_a_copy_under_concurrent_pushes_is_the_copy_then_some_pushes_never_a_mix(router):
    size = 200_000
    source = Member(router.address, 0, Adam(lr=0.01), seed=1, size=size)
    target = Member(router.address, 1, Adam(lr=0.01), seed=2, size=size)
    reference = Member(router.address, 2, Adam(lr=0.01), seed=3, size=size)
    control = NamespaceControl([router.address], SECRET, timeout_s=30.0)
    pushes = 30
    try:
        for i in range(3):
            source.step(1.0, seed=i)
        started = threading.Event()
        failure: list[BaseException] = []

        def push() -> None:
            try:
                for i in range(pushes):
                    target.step(0.25, seed=1000)
                    if i == 2:
                        started.set()
            except BaseException as exc:  # reported below
                failure.append(exc)
                started.set()

        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        assert started.wait(30.0), "the pushing thread made no push"
        copied = control.copy_model(source.model, target.model)
        pusher.join(60.0)
        assert not pusher.is_alive(), "the pushing thread did not finish"
        assert not failure, failure
        final = router.state(target.model)
        assert final[2] == pushes
        after_copy = final[2] - copied.target_versions[0]  # pushes applied after the copy
        assert 0 <= after_copy < pushes
        # The reference: the source's state, copied, then as many of the same pushes.
        control.copy_model(source.model, reference.model)
        for _ in range(after_copy):
            reference.step(0.25, seed=1000)
        _assert_same_state(final, router.state(reference.model))
    finally:
        control.close()
        for member in (source, target, reference):
            member.client.close()


def test_set_hyperparameters_changes_the_next_updates_and_keeps_the_optimizer_state(router):
    member = Member(router.address, 0, SGD(lr=0.5, momentum=0.9), seed=1)
    twin = Member(router.address, 1, SGD(lr=0.5, momentum=0.9), seed=1)
    control = NamespaceControl([router.address], SECRET, timeout_s=10.0)
    try:
        member.step(1.0, seed=0)
        twin.step(1.0, seed=0)
        hyper = control.set_hyperparameters(member.model, {"lr": 0.05, "weight_decay": 0.01})
        assert hyper == {"lr": 0.05, "momentum": 0.9, "nesterov": False, "weight_decay": 0.01}
        assert router.router.models[member.model].store.rule.hyperparameters["lr"] == 0.05
        # The same as torch.optim.SGD whose param group is changed between two steps.
        w = torch.nn.Parameter(torch.randn(1000, generator=torch.Generator().manual_seed(1)))
        optimizer = torch.optim.SGD([w], lr=0.5, momentum=0.9)
        w.grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))
        optimizer.step()
        assert torch.equal(w.detach(), twin.w.detach())
        optimizer.param_groups[0].update(lr=0.05, weight_decay=0.01)
        member.step(1.0, seed=5)
        w.grad = torch.randn(1000, generator=torch.Generator().manual_seed(5))
        optimizer.step()
        assert torch.equal(w.detach(), member.w.detach())
        with pytest.raises(RequestRefused, match="unknown hyperparameter 'betas'"):
            control.set_hyperparameters(member.model, {"betas": [0.9, 0.99]})
        with pytest.raises(RequestRefused, match="must be a finite number"):
            control.set_hyperparameters(member.model, {"lr": float("nan")})
    finally:
        control.close()
        for m in (member, twin):
            m.client.close()


def test_copies_between_models_that_differ_or_do_not_exist_are_refused(router):
    adam = Member(router.address, 0, Adam(lr=0.01), seed=1)
    sgd = Member(router.address, 1, SGD(lr=0.01), seed=2)
    other = Member(router.address, 2, Adam(lr=0.01), seed=3, size=10)
    control = NamespaceControl([router.address], SECRET, timeout_s=10.0)
    try:
        before = router.state(sgd.model)
        with pytest.raises(RequestRefused, match="the optimizer state of one rule does not fit"):
            control.copy_model(adam.model, sgd.model)
        _assert_same_state(router.state(sgd.model), before)  # nothing changed
        with pytest.raises(RequestRefused, match="their variables differ"):
            control.copy_model(adam.model, other.model)
        with pytest.raises(RequestRefused, match="cannot be copied onto itself"):
            control.copy_model(adam.model, adam.model)
        with pytest.raises(NotInitialized, match="holds no model 'ghost' \\('source'\\)"):
            control.copy_model("ghost", adam.model)
    finally:
        control.close()
        for member in (adam, sgd, other):
            member.client.close()


def test_a_copy_takes_the_moving_average_too_and_refuses_a_member_without_one(router):
    ema = UpdateDiscipline(ema_decay=0.9)
    source = Member(router.address, 0, Adam(lr=0.01), seed=1, discipline=ema)
    target = Member(router.address, 1, Adam(lr=0.01), seed=2, discipline=ema)
    plain = Member(router.address, 2, Adam(lr=0.01), seed=3)
    control = NamespaceControl([router.address], SECRET, timeout_s=10.0)
    try:
        for i in range(3):
            source.step(1.0, seed=i)
        target.step(2.0, seed=5)
        control.copy_model(source.model, target.model)
        averages = [
            router.router.models[m.model].store.moving_average_snapshot() for m in (source, target)
        ]
        assert all(torch.equal(a, b) for a, b in zip(*averages, strict=True))
        _assert_same_state(router.state(target.model), router.state(source.model))
        with pytest.raises(RequestRefused, match="differ in keeping a moving average"):
            control.copy_model(source.model, plain.model)
    finally:
        control.close()
        for member in (source, target, plain):
            member.client.close()
