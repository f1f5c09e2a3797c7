"""The NaN guard (:class:`tensorfleet.session.hooks.NanGuard`) end to end in a one-process
:class:`TrainingSession` (no cluster).

Covered: ``action="stop"`` raises :class:`NonFiniteError` naming the task, the problem and the
global step, before the bad update touches the parameters; ``action="skip"`` leaves the
parameters bit for bit as they were, counts the step in ``skipped``, and raises after
``max_consecutive`` bad steps in a row (a good step resets the count); a finite loss with a
non-finite gradient is caught too; bad constructor arguments are refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensorfleet.errors import NonFiniteError
from tensorfleet.ps.update_rules import SGD, Adam, Momentum, UpdateRule
from tensorfleet.session.hooks import NanGuard
from tensorfleet.session.training_session import TrainingSession
from tensorfleet.wire.tensors import as_buffer

pytestmark = pytest.mark.timeout(60)

X = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25]])
Y = torch.tensor([[1.0], [-1.0], [2.0]])


def _model() -> nn.Linear:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -0.25]]))
        model.bias.copy_(torch.tensor([0.125]))
    return model


def _good(model: nn.Module) -> torch.Tensor:
    return ((model(X) - Y) ** 2).mean()


def _nan_loss(model: nn.Module) -> torch.Tensor:
    return _good(model) * float("nan")


def _inf_loss(model: nn.Module) -> torch.Tensor:
    return _good(model) + float("inf")


class _InfiniteGradient(torch.autograd.Function):
    """Identity forward; its backward answers +inf whatever comes in."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf"))


def _inf_gradient(model: nn.Linear) -> torch.Tensor:
    """A finite loss (the good one) whose backward makes the weight's gradient infinite."""
    return _good(model) + 0.0 * _InfiniteGradient.apply(model.weight).sum()


def _bits(model: nn.Module) -> list[bytes]:
    return [bytes(as_buffer(p.detach().contiguous())) for p in model.parameters()]


def _session(model: nn.Module, guard: NanGuard, rule: UpdateRule | None = None) -> TrainingSession:
    return TrainingSession(None, model, rule or SGD(lr=0.5), hooks=[guard])


# -- skip -------------------------------------------------------------------------------------------


def test_skip_leaves_the_parameters_bit_for_bit_and_counts_the_step() -> None:
    model, guard = _model(), NanGuard(action="skip")
    with _session(model, guard) as session:
        session.step(lambda: _good(model))
        after_good = _bits(model)

        result = session.step(lambda: _nan_loss(model))

        assert _bits(model) == after_good
        assert guard.skipped == 1
        assert result.loss != result.loss  # NaN
        session.step(lambda: _good(model))
        assert _bits(model) != after_good

    # The run is exactly the two good steps: the bad one left no trace.
    reference = _model()
    with TrainingSession(None, reference, SGD(lr=0.5)) as session:
        session.step(lambda: _good(reference))
        session.step(lambda: _good(reference))
    assert _bits(model) == _bits(reference)


def test_without_the_guard_a_nan_loss_would_poison_the_parameters() -> None:
    """Guard for the test above: the bad step really would change the parameters."""
    model = _model()
    with TrainingSession(None, model, SGD(lr=0.5)) as session:
        session.step(lambda: _nan_loss(model))
    assert torch.isnan(model.weight).all()


@pytest.mark.parametrize(
    "rule", [Momentum(lr=0.5, momentum=0.9), Adam(lr=0.5)], ids=["momentum", "adam"]
)
def test_skip_leaves_the_parameters_unchanged_with_a_stateful_rule(rule: UpdateRule) -> None:
    model, guard = _model(), NanGuard(action="skip")
    with _session(model, guard, rule) as session:
        session.step(lambda: _good(model))
        after_good = _bits(model)
        session.step(lambda: _nan_loss(model))
        assert guard.skipped == 1
        assert _bits(model) == after_good


def test_skip_stops_after_max_consecutive_bad_steps_in_a_row() -> None:
    model, guard = _model(), NanGuard(action="skip", max_consecutive=2)
    with pytest.raises(NonFiniteError) as caught, _session(model, guard) as session:
        session.step(lambda: _good(model))
        after_good = _bits(model)
        session.step(lambda: _nan_loss(model))
        assert guard.skipped == 1
        session.step(lambda: _inf_loss(model))
    message = str(caught.value)
    assert "local: loss inf at global step" in message
    assert "(2 bad steps in a row); the update was not applied" in message
    assert guard.skipped == 1
    assert _bits(model) == after_good


def test_a_good_step_resets_the_count_of_bad_steps_in_a_row() -> None:
    model, guard = _model(), NanGuard(action="skip", max_consecutive=2)
    with _session(model, guard) as session:
        for _ in range(3):
            session.step(lambda: _nan_loss(model))
            session.step(lambda: _good(model))
    assert guard.skipped == 3


def test_skip_with_max_consecutive_one_stops_at_the_first_bad_step() -> None:
    model, guard = _model(), NanGuard(action="skip", max_consecutive=1)
    before = _bits(model)
    with pytest.raises(NonFiniteError, match=r"\(1 bad steps in a row\)"):
        with _session(model, guard) as session:
            session.step(lambda: _nan_loss(model))
    assert guard.skipped == 0
    assert _bits(model) == before


# -- stop -------------------------------------------------------------------------------------------


def test_stop_raises_naming_the_global_step_and_leaves_the_parameters() -> None:
    model, guard = _model(), NanGuard()
    assert guard.action == "stop"
    with pytest.raises(NonFiniteError) as caught, _session(model, guard) as session:
        session.step(lambda: _good(model))
        session.step(lambda: _good(model))
        after_good = _bits(model)
        session.step(lambda: _nan_loss(model))
    message = str(caught.value)
    assert message.startswith("local: loss nan at global step 2; the update was not applied")
    assert "bad steps in a row" not in message
    assert isinstance(caught.value, ArithmeticError)
    assert _bits(model) == after_good
    assert guard.skipped == 0


def test_stop_on_an_infinite_loss() -> None:
    model = _model()
    before = _bits(model)
    with pytest.raises(NonFiniteError, match=r"^local: loss inf at global step 0;"):
        with _session(model, NanGuard(action="stop")) as session:
            session.step(lambda: _inf_loss(model))
    assert _bits(model) == before


# -- a finite loss with a non-finite gradient ------------------------------------------------------


def test_the_custom_function_makes_a_finite_loss_with_an_infinite_gradient() -> None:
    """Guard for the tests below."""
    model = _model()
    loss = _inf_gradient(model)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isinf(model.weight.grad).all()
    assert torch.isfinite(model.bias.grad).all()


def test_stop_on_a_non_finite_gradient_with_a_finite_loss() -> None:
    model = _model()
    before = _bits(model)
    with pytest.raises(
        NonFiniteError, match=r"^local: a non-finite gradient at global step 0; the update"
    ):
        with _session(model, NanGuard(action="stop")) as session:
            session.step(lambda: _inf_gradient(model))
    assert _bits(model) == before


def test_skip_on_a_non_finite_gradient_with_a_finite_loss() -> None:
    model, guard = _model(), NanGuard(action="skip")
    before = _bits(model)
    with _session(model, guard) as session:
        result = session.step(lambda: _inf_gradient(model))
    assert result.loss == float(_good(_model()).detach())
    assert guard.skipped == 1
    assert _bits(model) == before


# -- arguments --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"action": "ignore"}, r"action must be 'stop' or 'skip', got 'ignore'"),
        ({"action": "STOP"}, r"action must be 'stop' or 'skip', got 'STOP'"),
        ({"action": None}, r"action must be 'stop' or 'skip', got None"),
        ({"max_consecutive": 0}, r"max_consecutive must be >= 1, got 0"),
        ({"action": "skip", "max_consecutive": -3}, r"max_consecutive must be >= 1, got -3"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NanGuard(**kwargs)


def test_defaults() -> None:
    guard = NanGuard()
    assert (guard.action, guard.max_consecutive, guard.skipped) == ("stop", 100, 0)
